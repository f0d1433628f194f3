// The int8 pool's split walk with the bytes decoded straight into tensor-core operand registers.
//
// Triton decodes an int8 tile in a blocked layout and hands it to tl.dot through shared memory as
// fp16 (twice the bytes, a store and a reload per element). Here every thread loads exactly the bytes
// its mma.sync m16n8k16 fragments hold, 16 bytes per load, and decodes them in registers with byte
// permutes (fp16 bits 0x64 | (x + 128) are 1152 + x, exactly). Two permutations make that possible;
// both are free because a dot product does not care in which order it sums:
//   Q.K^T: thread (r, c) = (lane / 4, lane % 4) holds, at k-step s, K channels 4s .. 4s + 3 of its own
//          quarter c * D/4 .. of the head (logical k 16s + 2c + {0, 1, 8, 9}); q is loaded the same way.
//   P.V:   thread r holds V channels r * D/8 .. (r + 1) * D/8 of its tokens, so n-tile e, column n is
//          channel n * D/8 + e; the output is un-permuted once, when the warps' partials are combined.
// K's per-(block, channel) scale is folded into q once per block; V's per-token scale into p.
//
// Program (batch row, kv head, split) = WARPS warps, each walking its own part of the split's blocks
// with its own online softmax (log2 domain), combined through shared memory at the end. The GQA group
// is the mma's M (rows >= 8 stay zero: groups of up to 8 q heads). Writes exactly what Triton's
// _split_kernel writes for a warm-only launch: o_part (normalised), lse_part, and per-block lse.
// Compiled at run time with NVRTC (int8_mma.py); no CUDA headers needed.

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

struct Params {
    const u16* q; i64 s_q_batch, s_q_head;                       // fp16 [B, Hq, D], elements
    const signed char* warm; i64 s_w_slot, s_w_kv, s_w_head, s_w_tok;  // int8 [n, 2, H, T, D], bytes
    const float* k_scale; i64 s_ks_slot, s_ks_head;                // [n, H, D]
    const float* v_scale; i64 s_vs_slot, s_vs_head;                // [n, H, T]
    const int* table; const int* pos; i64 s_tab_batch, s_tab_head, s_tab_blk;
    const int* num_tokens;                                         // [B]
    const int* num_fp16; i64 s_nf_batch, s_nf_head;                // partitioned: the row's fp16 count
    float* o_part; float* lse_part; float* lse_block;
    float qk_scale;
    int blocks_per_split, pool_splits, split_base, num_splits, max_blocks, num_q_heads, group, blocks_per_iter;
    int partitioned, return_mass;
};

#define NEG_INF __int_as_float(0xff800000)
#define V_BOOST 256.0f  // p * v_scale * 256 stays out of fp16's subnormals (Triton's kernel does the same)

__device__ __forceinline__ float h2f(u16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}

__device__ __forceinline__ u32 pack_h2(float lo, float hi) {  // lo -> bits 0..15
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ u32 minus_1152(u32 x) {  // two fp16 1152 + v -> v, exactly
    u32 r;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(0x64806480u));
    return r;
}

// D += A.B for rows 0..7 (rows 8..15 of A are zero and their results dropped)
__device__ __forceinline__ void mma_rows8(float& d0, float& d1, u32 a0, u32 a2, u32 b0, u32 b1) {
    float z0, z1;
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%10,%11};"
        : "+f"(d0), "+f"(d1), "=f"(z0), "=f"(z1)
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(0.f), "f"(0.f));
}

template <int WORDS>
__device__ __forceinline__ void load_words(u32 (&w)[WORDS], const signed char* src) {
    if constexpr (WORDS % 4 == 0) {
        #pragma unroll
        for (int i = 0; i < WORDS / 4; ++i) {
            const uint4 x = reinterpret_cast<const uint4*>(src)[i];
            w[4 * i] = x.x; w[4 * i + 1] = x.y; w[4 * i + 2] = x.z; w[4 * i + 3] = x.w;
        }
    } else {
        static_assert(WORDS == 2, "2 or a multiple of 4 words");
        const uint2 x = *reinterpret_cast<const uint2*>(src);
        w[0] = x.x; w[1] = x.y;
    }
}

template <int D, int T, int WARPS>
__device__ __forceinline__ void int8_split_body(const Params& p) {
    constexpr int CH = T < 32 ? T : 32;  // tokens per step of the walk
    constexpr int NT = CH / 8;           // Q.K^T n-tiles per step
    constexpr int KS = D / 16;           // Q.K^T k-steps; also K words per thread and token
    constexpr int VS = CH / 16;          // P.V k-steps per step
    constexpr int VN = D / 8;            // P.V n-tiles
    constexpr int VW = D / 32;           // V words per thread and token
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r = lane >> 2, c = lane & 3;
    const int b = blockIdx.x, head = blockIdx.y, split = p.split_base + blockIdx.z;
    const int n_tok = p.num_tokens[b];
    const int n_blocks = min((n_tok + T - 1) / T, p.max_blocks);
    int lo, hi;
    if (p.partitioned) {  // the int8 entries of partition.py's row: [num_fp16, n_blocks), split as Triton's kernel does
        const int pool_lo = p.num_fp16[b * p.s_nf_batch + head * p.s_nf_head];
        int per = (n_blocks - pool_lo + p.pool_splits - 1) / p.pool_splits;
        per = (per + p.blocks_per_iter - 1) / p.blocks_per_iter * p.blocks_per_iter;
        lo = pool_lo + (split - p.pool_splits) * per;
        hi = min(lo + per, n_blocks);
    } else {
        lo = split * p.blocks_per_split;
        hi = min(lo + p.blocks_per_split, n_blocks);
    }
    const int per_warp = max(0, (hi - lo + WARPS - 1) / WARPS);
    const int wlo = lo + warp * per_warp, whi = min(wlo + per_warp, hi);

    const bool g_ok = r < p.group;
    const int q_head = head * p.group + r;
    float qf[D / 4];  // this thread's quarter of its q head, times qk_scale
    {
        const u16* qrow = p.q + b * p.s_q_batch + (i64)q_head * p.s_q_head + c * (D / 4);
        #pragma unroll
        for (int i = 0; i < D / 4; ++i) qf[i] = g_ok ? h2f(qrow[i]) * p.qk_scale : 0.f;
    }
    float m = NEG_INF, l = 0.f;  // m: row r's running max (same on its 4 lanes); l: this lane's share
    float acc[VN][2];
    #pragma unroll
    for (int e = 0; e < VN; ++e) acc[e][0] = acc[e][1] = 0.f;

    const int* trow = p.table + b * p.s_tab_batch + head * p.s_tab_head;
    const int* prow = p.pos + b * p.s_tab_batch + head * p.s_tab_head;
    for (int blk = wlo; blk < whi; ++blk) {
        const i64 slot = trow[blk * p.s_tab_blk];
        const int pos = p.partitioned ? prow[blk * p.s_tab_blk] : blk;
        const int valid = min(T, n_tok - pos * T);
        const signed char* kbase = p.warm + slot * p.s_w_slot + head * p.s_w_head;
        const signed char* vbase = kbase + p.s_w_kv;
        const float* vs_row = p.v_scale + slot * p.s_vs_slot + head * p.s_vs_head;
        u32 qa[KS][2];  // q * K's scale for this block, as A fragments
        {
            const float4* ks = reinterpret_cast<const float4*>(
                p.k_scale + slot * p.s_ks_slot + head * p.s_ks_head + c * (D / 4));
            #pragma unroll
            for (int s = 0; s < KS; ++s) {
                const float4 k4 = ks[s];
                qa[s][0] = pack_h2(qf[4 * s] * k4.x, qf[4 * s + 1] * k4.y);
                qa[s][1] = pack_h2(qf[4 * s + 2] * k4.z, qf[4 * s + 3] * k4.w);
            }
        }
        float bsum = 0.f;  // this lane's share of the block's p, relative to m
        #pragma unroll
        for (int t0 = 0; t0 < T; t0 += CH) {
            u32 kw[NT][KS];  // n-tile j: token t0 + 8j + r, channels c * D/4 ..
            #pragma unroll
            for (int j = 0; j < NT; ++j) load_words(kw[j], kbase + (t0 + 8 * j + r) * p.s_w_tok + c * (D / 4));
            u32 vw[VS][4][VW];  // k-step v: tokens t0 + 16v + 2c + {0, 1, 8, 9}, channels r * D/8 ..
            #pragma unroll
            for (int v = 0; v < VS; ++v)
                #pragma unroll
                for (int x = 0; x < 4; ++x)
                    load_words(vw[v][x], vbase + (t0 + 16 * v + 2 * c + (x & 1) + 8 * (x >> 1)) * p.s_w_tok + r * (D / 8));
            float2 vsc[NT];  // V's scale of the score columns: tokens t0 + 8j + 2c + {0, 1}
            #pragma unroll
            for (int j = 0; j < NT; ++j) vsc[j] = *reinterpret_cast<const float2*>(vs_row + t0 + 8 * j + 2 * c);

            float sc[NT][2];
            #pragma unroll
            for (int j = 0; j < NT; ++j) {
                sc[j][0] = sc[j][1] = 0.f;
                #pragma unroll
                for (int s = 0; s < KS; ++s) {
                    const u32 t = kw[j][s] ^ 0x80808080u;
                    const u32 b0 = minus_1152(__byte_perm(t, 0x64646464u, 0x4140));
                    const u32 b1 = minus_1152(__byte_perm(t, 0x64646464u, 0x4342));
                    mma_rows8(sc[j][0], sc[j][1], qa[s][0], qa[s][1], b0, b1);
                }
            }
            float mx = NEG_INF;
            #pragma unroll
            for (int j = 0; j < NT; ++j)
                #pragma unroll
                for (int i = 0; i < 2; ++i) {
                    if (t0 + 8 * j + 2 * c + i >= valid) sc[j][i] = NEG_INF;
                    mx = fmaxf(mx, sc[j][i]);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m, mx);
            const float m_use = m_new == NEG_INF ? 0.f : m_new;
            const float alpha = exp2f(m - m_use);
            m = m_new;
            l *= alpha;
            bsum *= alpha;
            #pragma unroll
            for (int e = 0; e < VN; ++e) { acc[e][0] *= alpha; acc[e][1] *= alpha; }
            u32 pa[NT];  // p * v_scale * V_BOOST, packed: j even -> a0, j odd -> a2 of k-step j / 2
            #pragma unroll
            for (int j = 0; j < NT; ++j) {
                float pv[2];
                #pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const float pr = exp2f(sc[j][i] - m_use);
                    l += pr;
                    bsum += pr;
                    const float vscale = i == 0 ? vsc[j].x : vsc[j].y;
                    pv[i] = t0 + 8 * j + 2 * c + i < valid ? pr * vscale * V_BOOST : 0.f;  // a select: v_scale may be junk there
                }
                pa[j] = pack_h2(pv[0], pv[1]);
            }
            #pragma unroll
            for (int v = 0; v < VS; ++v)
                #pragma unroll
                for (int e = 0; e < VN; ++e) {
                    const int w = e / 4, sel = (e % 4) | ((4 + e % 4) << 8);
                    const u32 b0 = minus_1152((__byte_perm(vw[v][0][w], vw[v][1][w], sel) & 0x00ff00ffu) ^ 0x64806480u);
                    const u32 b1 = minus_1152((__byte_perm(vw[v][2][w], vw[v][3][w], sel) & 0x00ff00ffu) ^ 0x64806480u);
                    mma_rows8(acc[e][0], acc[e][1], pa[2 * v], pa[2 * v + 1], b0, b1);
                }
        }
        if (p.return_mass) {
            float bs = bsum + __shfl_xor_sync(0xffffffffu, bsum, 1);
            bs += __shfl_xor_sync(0xffffffffu, bs, 2);
            const float m_use = m == NEG_INF ? 0.f : m;
            if (c == 0 && g_ok)
                p.lse_block[((i64)b * p.num_q_heads + q_head) * p.max_blocks + pos] = bs > 0.f ? m_use + log2f(bs) : NEG_INF;
        }
    }
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);

    __shared__ float sm_m[WARPS][8], sm_l[WARPS][8];
    __shared__ float sm_acc[WARPS][8][D];  // physical channel order
    if (c == 0) { sm_m[warp][r] = m; sm_l[warp][r] = l; }
    #pragma unroll
    for (int e = 0; e < VN; ++e) {
        sm_acc[warp][r][(2 * c) * (D / 8) + e] = acc[e][0];
        sm_acc[warp][r][(2 * c + 1) * (D / 8) + e] = acc[e][1];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < p.group * D; idx += WARPS * 32) {
        const int row = idx / D, ch = idx % D;
        float mm = NEG_INF;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, sm_m[w][row]);
        float ll = 0.f, o = 0.f;
        if (mm != NEG_INF) {
            #pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float f = exp2f(sm_m[w][row] - mm);
                ll += sm_l[w][row] * f;
                o += sm_acc[w][row][ch] * f;
            }
        }
        const i64 part = ((i64)b * p.num_q_heads + head * p.group + row) * p.num_splits + split;
        p.o_part[part * D + ch] = ll > 0.f ? o / (ll * V_BOOST) : 0.f;
        if (ch == 0) p.lse_part[part] = ll > 0.f ? mm + log2f(ll) : NEG_INF;
    }
}
