// The int8 pool's split walk with the bytes decoded straight into tensor-core operand registers.
//
// Triton decodes an int8 tile in a blocked layout and hands it to tl.dot through shared memory as
// fp16 (twice the bytes, a store and a reload per element). Here each warp streams its chunks (<= 32
// tokens of one block: K and V bytes, K's and V's scales) into shared memory with cp.async, STAGES
// chunks deep, so the next chunk's bytes are in flight while one is computed; every lane then reads
// exactly the 16-byte pieces its mma.sync m16n8k16 fragments hold (XOR-swizzled: no bank conflicts)
// and decodes them in registers with byte permutes (fp16 bits 0x64 | (x + 128) are 1152 + x, exactly).
//
// Both products are computed transposed, so the GQA group (up to 8 q heads) is the mma's N and no
// operand row is padding: S^T = K.Q^T (K the A operand, 16 tokens a tile; q the B operand) and
// O^T = V^T.P^T (V^T the A operand, 16 channels an m-tile; P^T the B operand, made from the score
// accumulator by one movmatrix transpose per 8 tokens). Two permutations make every lane's bytes
// contiguous; both are free because a dot product does not care in which order it sums:
//   K:  lane (r, c) = (lane / 4, lane % 4) holds, at k-step s, channels c * D/4 + 4s .. + 3 (logical k
//       16s + 2c + {0, 1, 8, 9}) of tokens r and r + 8; q is loaded the same way.
//   V:  lane r holds channels r * D/8 .. (r + 1) * D/8 of its tokens: m-tile e's rows r, r + 8 are
//       channels r * D/8 + 2e, + 1; the output is un-permuted once, when the warps' partials are combined.
// K's per-(block, channel) scale is folded into q once per block (in fp16, as Triton's kernel scales K);
// V's per-token scale into p. The decoded operands are 1152 + v; the 1152s come off in fp32, not per
// element: a block's scores start at -1152 sum(q') (one mma per k-step against a constant -1152
// operand), and P.V's surplus 1152 sum(p') is accumulated beside it (one mma per k-step against 1152)
// and subtracted at the end. The score scale (log2(e) / sqrt(D), positive) is applied in the exponent's FMA:
// the running max is taken over raw scores and scaled once; the accumulators are rescaled only when a
// running max moves, and l gets each block's sum of p at the block's end.
//
// Every shared-memory address is a shared-space u32 computed from lane constants once per warp, and every
// copy's source a compile-time offset from its chunk's base (a block's tokens are D bytes apart), so a chunk's
// 16-byte copies and fragment reads cost no address arithmetic (otherwise a fifth of the instructions:
// BENCHMARKS.md, Int8 kernels). Launched programmatically after the partition walk's fp16 launch (int8_mma.py), the
// grid waits for that one before it ends.
//
// Program (batch row, kv head, split) = WARPS warps, each walking its own part of the split's blocks
// with its own online softmax (log2 domain), combined through shared memory at the end. Writes exactly
// what Triton's _split_kernel writes for a warm-only launch: o_part (normalised), lse_part, and the
// per-block lse H2O's mass comes from. Compiled at run time with NVRTC (int8_mma.py); includes only kvcuda/device.cuh.

#include "kvcuda/device.cuh"

struct Params {
    const u16* q; i64 s_q_batch, s_q_head;                       // fp16 [B, Hq, D], elements
    const signed char* warm; i64 s_w_slot, s_w_kv, s_w_head;  // int8 [n, 2, H, T, D], bytes; a token's D bytes apart
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

#define V_BOOST 256.0f  // p * v_scale * 256 stays out of fp16's subnormals (Triton's kernel does the same)
#define H2_1152 0x64806480u       // fp16x2 (1152, 1152)
#define H2_MINUS_1152 0xe480e480u // fp16x2 (-1152, -1152)

// the warp's 8x8 fp16 matrix (lane 4r + c holds row r, columns 2c, 2c + 1), transposed
__device__ __forceinline__ u32 transpose8x8(u32 x) {
    u32 y;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}


template <int WORDS>
__device__ __forceinline__ void lds_words(u32 (&w)[WORDS], u32 src) {  // src: a shared-space address
    if constexpr (WORDS % 4 == 0) {
        #pragma unroll
        for (int i = 0; i < WORDS / 4; ++i) {
            const uint4 x = lds128(src + 16 * i);
            w[4 * i] = x.x; w[4 * i + 1] = x.y; w[4 * i + 2] = x.z; w[4 * i + 3] = x.w;
        }
    } else {
        static_assert(WORDS == 2, "2 or a multiple of 4 words");
        const uint2 x = lds64(src);
        w[0] = x.x; w[1] = x.y;
    }
}

template <int D, int T>
struct Geometry {
    static constexpr int CH = T < 32 ? T : 32;  // tokens per chunk (a step of the walk)
    static constexpr int CPB = T / CH;          // chunks per block
    static constexpr int ROW = D;               // a token's bytes in shared memory
    static constexpr int PIECES = D / 16;       // its 16-byte pieces; piece i of row t sits at i ^ (t % PIECES),
                                                // so the fragment reads of 8 lanes hit 8 different bank groups
    static constexpr int K_OFF = 0, V_OFF = CH * ROW, KS_OFF = 2 * CH * ROW, VS_OFF = KS_OFF + 4 * D;
    static constexpr int POS_OFF = VS_OFF + 4 * CH;  // the chunk's block position in the table
    static constexpr int STAGE = POS_OFF + 16;       // bytes per chunk, a multiple of 16 (int8_mma.py mirrors this)
};

template <int D, int T, int WARPS, int STAGES>
__device__ __forceinline__ void int8_split_body(const Params& p) {
    using G = Geometry<D, T>;
    constexpr int CH = G::CH, CPB = G::CPB, ROW = G::ROW;
    constexpr int KS = D / 16;   // Q.K^T k-steps; also K words per thread and token
    constexpr int VS = CH / 16;  // 16-token tiles per chunk: Q.K^T's m-tiles, P.V's k-steps
    constexpr int VM = D / 16;   // P.V m-tiles (16 channels each)
    constexpr int VW = D / 32;   // V words per thread and token
    extern __shared__ __align__(16) unsigned char smem[];
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
    const int n_items = max(0, whi - wlo) * CPB;
    const u32 stages = smem_addr(smem) + warp * STAGES * G::STAGE;  // shared-space addresses from here on

    const int* trow = p.table + b * p.s_tab_batch + head * p.s_tab_head;
    const int* prow = p.pos + b * p.s_tab_batch + head * p.s_tab_head;
    int tab_base = -1, tab_slot = 0, tab_pos = 0;  // entries tab_base + lane, 32 at a time
    auto entry = [&](int blk, i64& slot, int& pos) {
        const int base = blk & ~31;
        if (base != tab_base) {
            tab_base = base;
            const int e = base + lane;
            tab_slot = e < whi ? trow[e * p.s_tab_blk] : 0;
            tab_pos = p.partitioned ? (e < whi ? prow[e * p.s_tab_blk] : 0) : e;
        }
        slot = __shfl_sync(0xffffffffu, tab_slot, blk & 31);
        pos = __shfl_sync(0xffffffffu, tab_pos, blk & 31);
    };
    // A chunk's copies: lane (row, piece) = (lane / (D/16), lane % (D/16)) copies 16 bytes of rows row + i * RPC.
    // A block's rows are D bytes apart (usable() checks), so every source offset is a constant; the destinations
    // repeat their swizzle every PERIOD copies, so they are PERIOD lane offsets plus constants.
    constexpr int RPC = 32 / (D / 16);  // token rows one 16-byte copy per lane covers
    constexpr int COPIES = CH * D / 16 / 32;
    constexpr int PERIOD = RPC >= G::PIECES ? 1 : G::PIECES / RPC;
    static_assert(CH % RPC == 0 && COPIES % PERIOD == 0, "a chunk is a whole number of copies");
    const int lane_row = lane / (D / 16), lane_piece = lane % (D / 16);
    u32 dst_at[PERIOD];
    #pragma unroll
    for (int j = 0; j < PERIOD; ++j) {
        const int row = lane_row + j * RPC;
        dst_at[j] = row * ROW + 16 * (lane_piece ^ (row % G::PIECES));
    }
    auto issue = [&](int item) {  // chunk `item` of this warp's walk -> stage item % STAGES
        const int blk = wlo + item / CPB, t0 = (item % CPB) * CH;
        i64 slot; int pos;
        entry(blk, slot, pos);
        const signed char* k_src =
            p.warm + slot * p.s_w_slot + head * p.s_w_head + (t0 + lane_row) * D + 16 * lane_piece;
        const signed char* v_src = k_src + p.s_w_kv;
        const u32 dst = stages + (item % STAGES) * G::STAGE;
        #pragma unroll
        for (int i = 0; i < COPIES; ++i) {
            const u32 at = dst_at[i % PERIOD] + (i / PERIOD) * PERIOD * RPC * ROW;
            cp_async16_l2(dst + G::K_OFF + at, k_src + i * RPC * D);
            cp_async16_l2(dst + G::V_OFF + at, v_src + i * RPC * D);
        }
        if (t0 == 0) {  // K's scales: read with the block's first chunk only
            const float* ks = p.k_scale + slot * p.s_ks_slot + head * p.s_ks_head;
            for (int i = lane; i < D / 4; i += 32) cp_async16_l2(dst + G::KS_OFF + 16 * i, ks + 4 * i);
        }
        const float* vs = p.v_scale + slot * p.s_vs_slot + head * p.s_vs_head + t0;
        if (lane < CH / 4) cp_async16_l2(dst + G::VS_OFF + 16 * lane, vs + 4 * lane);
        if (lane == 0) sts32(dst + G::POS_OFF, pos);
    };

    // Fragments (lane = 4r + c). Q.K^T is computed transposed, S^T = K.Q^T: K is the A operand (16 tokens a
    // tile: rows r and r + 8), q the B operand (its 8 columns are the group's q heads, c's pair 2c, 2c + 1 in
    // the accumulator). P.V likewise, O^T = V^T.P^T: V^T is A (16 channels an m-tile: thread r holds channels
    // r * D/8 + 2e and + 1 of m-tile e) and P^T is B, made from the score accumulator by one movmatrix
    // transpose per 8 tokens. No operand row is padding, so every mma does useful work for up to 8 q heads.
    u32 qh[KS][2];  // q head r: channels c * D/4 + 4s + {0, 1} and {2, 3}
    {
        const bool ok = r < p.group;
        const u32* qrow = reinterpret_cast<const u32*>(p.q + b * p.s_q_batch + (i64)(head * p.group + r) * p.s_q_head
                                                       + c * (D / 4));
        #pragma unroll
        for (int s = 0; s < KS; ++s) {
            qh[s][0] = ok ? qrow[2 * s] : 0u;
            qh[s][1] = ok ? qrow[2 * s + 1] : 0u;
        }
    }
    const bool h_ok[2] = {2 * c < p.group, 2 * c + 1 < p.group};  // this lane's accumulator columns: q heads 2c, 2c + 1
    // per head: running max of the scaled scores (same on all r); this lane's share of l over the blocks before
    // this one
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    float acc[VM][4];  // O^T m-tile e: (channel r * D/8 + 2e, heads 2c, 2c + 1), (channel + 1, heads 2c, 2c + 1)
    #pragma unroll
    for (int e = 0; e < VM; ++e) acc[e][0] = acc[e][1] = acc[e][2] = acc[e][3] = 0.f;
    u32 qa[KS][2];                  // q * the block's K scale, as B fragments
    float s0[2] = {0.f, 0.f};       // -1152 sum(q * K's scale) per head: where the block's scores start
    float bsum[2] = {0.f, 0.f};     // this lane's share of the block's p per head, relative to m (into l at its end)
    float corr[2] = {0.f, 0.f};     // 1152 sum(p * v_scale * V_BOOST) per head, scaled with acc: acc's surplus

    #pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < n_items) issue(s);
        cp_async_commit();
    }
    // lane constants of the fragment reads (the swizzle's row % PIECES is r's or c's: 16v and 8h drop out)
    u32 k_at[KS / 4];  // K: rows r (+ 8h + 16v), pieces c * KS/4 + i
    #pragma unroll
    for (int i = 0; i < KS / 4; ++i) k_at[i] = G::K_OFF + r * ROW + 16 * ((c * KS / 4 + i) ^ (r % G::PIECES));
    u32 v_at[2];  // V: rows 2c + j (+ 8 (x >> 1) + 16v), bytes r * D/8 ..
    #pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int row = 2 * c + j, byte = r * (D / 8);
        v_at[j] = G::V_OFF + row * ROW + 16 * ((byte / 16) ^ (row % G::PIECES)) + byte % 16;
    }
    const float qk = p.qk_scale;  // > 0 (usable() checks): the max of the raw scores, scaled, is the scaled max
    for (int it = 0; it < n_items; ++it) {
        if (it + STAGES - 1 < n_items) issue(it + STAGES - 1);
        cp_async_commit();
        cp_async_wait<STAGES - 1>();
        __syncwarp();
        const u32 st = stages + (it % STAGES) * G::STAGE;
        const int t0 = (it % CPB) * CH, pos = static_cast<int>(lds32(st + G::POS_OFF));
        const int valid = min(T, n_tok - pos * T) - t0;  // tokens of this chunk that exist (may be <= 0)
        if (t0 == 0) {
            #pragma unroll
            for (int s = 0; s < KS; ++s) {
                const uint4 k4 = lds128(st + G::KS_OFF + 16 * (c * (D / 16) + s));
                // in fp16, as Triton's kernel scales K: q * scale rounds like k * scale
                qa[s][0] = hmul2(qh[s][0], pack_h2(__uint_as_float(k4.x), __uint_as_float(k4.y)));
                qa[s][1] = hmul2(qh[s][1], pack_h2(__uint_as_float(k4.z), __uint_as_float(k4.w)));
            }
            float d[4] = {0.f, 0.f, 0.f, 0.f};
            #pragma unroll
            for (int s = 0; s < KS; ++s)
                mma(d, H2_MINUS_1152, H2_MINUS_1152, H2_MINUS_1152, H2_MINUS_1152, qa[s][0], qa[s][1]);
            s0[0] = d[0];
            s0[1] = d[1];
        }
        float sc[VS][4];  // raw scores, tile v: (token 16v + r, heads 2c, 2c + 1), (token 16v + r + 8, heads ..)
        #pragma unroll
        for (int v = 0; v < VS; ++v) {
            u32 kw[2][KS];  // tokens 16v + r and 16v + r + 8, channels c * D/4 ..: pieces c * KS / 4 ..
            #pragma unroll
            for (int h = 0; h < 2; ++h)
                #pragma unroll
                for (int i = 0; i < KS / 4; ++i)
                    lds_words(reinterpret_cast<u32(&)[4]>(kw[h][4 * i]), st + k_at[i] + (16 * v + 8 * h) * ROW);
            sc[v][0] = sc[v][2] = s0[0];
            sc[v][1] = sc[v][3] = s0[1];
            #pragma unroll
            for (int s = 0; s < KS; ++s) {
                const u32 t0w = kw[0][s] ^ 0x80808080u, t1w = kw[1][s] ^ 0x80808080u;
                mma(sc[v], __byte_perm(t0w, 0x64646464u, 0x4140), __byte_perm(t1w, 0x64646464u, 0x4140),  // 1152 + K
                    __byte_perm(t0w, 0x64646464u, 0x4342), __byte_perm(t1w, 0x64646464u, 0x4342), qa[s][0], qa[s][1]);
            }
        }
        float mx[2] = {NEG_INF, NEG_INF};
        #pragma unroll
        for (int v = 0; v < VS; ++v)
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                if (16 * v + r + 8 * (i >> 1) >= valid) sc[v][i] = NEG_INF;
                mx[i & 1] = fmaxf(mx[i & 1], sc[v][i]);
            }
        float m_new[2], m_use[2];
        bool moved = false;
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 4));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 8));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 16));
            m_new[h] = fmaxf(m[h], mx[h] * qk);
            moved |= m_new[h] != m[h];
            m_use[h] = m_new[h] == NEG_INF ? 0.f : m_new[h];
        }
        if (__any_sync(0xffffffffu, moved)) {  // rescale only when a running max moved (alpha is 1 otherwise)
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float alpha = exp2f(m[h] - m_use[h]);
                l[h] *= alpha;
                bsum[h] *= alpha;
                corr[h] *= alpha;
                #pragma unroll
                for (int e = 0; e < VM; ++e) { acc[e][h] *= alpha; acc[e][h + 2] *= alpha; }
            }
        }
        m[0] = m_new[0];
        m[1] = m_new[1];
        #pragma unroll
        for (int v = 0; v < VS; ++v) {
            u32 pt[2];  // P^T B fragment: tokens 16v + 2c + {0, 1} (+ 8 for pt[1]), head r
            #pragma unroll
            for (int h = 0; h < 2; ++h) {  // h: token 16v + r + 8h
                const int tok = 16 * v + r + 8 * h;
                // a select: v_scale past the row's end may be NaN
                const float vs = tok < valid ? __uint_as_float(lds32(st + G::VS_OFF + 4 * tok)) * V_BOOST : 0.f;
                float pv[2];
                #pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const float pr = exp2f(fmaf(sc[v][2 * h + i], qk, -m_use[i]));
                    bsum[i] += pr;
                    pv[i] = pr * vs;
                }
                pt[h] = transpose8x8(pack_h2(pv[0], pv[1]));
            }
            // V: words biased once, then per register pair one gather of both tokens' bytes and two interleaves
            // with 0x64 (a mask and a bias per register cost 50% more instructions: BENCHMARKS.md, Int8 kernels)
            u32 vw[4][VW];  // tokens 16v + 2c + {0, 1, 8, 9}, channels r * D/8 .., as 128 + V
            #pragma unroll
            for (int x = 0; x < 4; ++x) {
                lds_words(vw[x], st + v_at[x & 1] + (16 * v + 8 * (x >> 1)) * ROW);
                #pragma unroll
                for (int w = 0; w < VW; ++w) vw[x][w] ^= 0x80808080u;
            }
            #pragma unroll
            for (int e = 0; e < VM; ++e) {  // channels 2e, 2e + 1 of the thread's D/8: word e / 2, bytes 2(e % 2) ..
                const int w = e / 2, k = 2 * (e % 2);
                const int both = k | ((4 + k) << 4) | ((k + 1) << 8) | ((5 + k) << 12);  // [a_k, b_k, a_k+1, b_k+1]
                const u32 lo = __byte_perm(vw[0][w], vw[1][w], both), hi = __byte_perm(vw[2][w], vw[3][w], both);
                mma(acc[e], __byte_perm(lo, 0x64646464u, 0x5140), __byte_perm(lo, 0x64646464u, 0x5342),  // 1152 + V
                    __byte_perm(hi, 0x64646464u, 0x5140), __byte_perm(hi, 0x64646464u, 0x5342), pt[0], pt[1]);
            }
            float d[4] = {corr[0], corr[1], 0.f, 0.f};
            mma(d, H2_1152, H2_1152, H2_1152, H2_1152, pt[0], pt[1]);
            corr[0] = d[0];
            corr[1] = d[1];
        }
        __syncwarp();  // the stage is refilled by the next iteration's issue
        if (t0 + CH == T) {  // the block's last chunk: its mass, and its p into l
            if (p.return_mass) {
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float bs = bsum[h] + __shfl_xor_sync(0xffffffffu, bsum[h], 4);
                    bs += __shfl_xor_sync(0xffffffffu, bs, 8);
                    bs += __shfl_xor_sync(0xffffffffu, bs, 16);
                    if (r == 0 && h_ok[h])
                        p.lse_block[((i64)b * p.num_q_heads + head * p.group + 2 * c + h) * p.max_blocks + pos] =
                            bs > 0.f ? m_use[h] + log2f(bs) : NEG_INF;
                }
            }
            l[0] += bsum[0];
            l[1] += bsum[1];
            bsum[0] = bsum[1] = 0.f;
        }
    }
    cp_async_wait<0>();
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 4);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 8);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 16);
    }

    __syncthreads();  // the stages are free: the combine reuses their memory
    float* sm_m = reinterpret_cast<float*>(smem);  // [WARPS][8]
    float* sm_l = sm_m + WARPS * 8;                 // [WARPS][8]
    float* sm_acc = sm_l + WARPS * 8;               // [WARPS][8][D], channels in memory order
    if (r == 0) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) { sm_m[warp * 8 + 2 * c + h] = m[h]; sm_l[warp * 8 + 2 * c + h] = l[h]; }
    }
    #pragma unroll
    for (int e = 0; e < VM; ++e)
        #pragma unroll
        for (int i = 0; i < 4; ++i)  // head 2c + (i & 1), channel r * D/8 + 2e + (i >> 1)
            sm_acc[(warp * 8 + 2 * c + (i & 1)) * D + r * (D / 8) + 2 * e + (i >> 1)] = acc[e][i] - corr[i & 1];
    __syncthreads();
    for (int idx = threadIdx.x; idx < p.group * D; idx += WARPS * 32) {
        const int row = idx / D, ch = idx % D;
        float mm = NEG_INF;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, sm_m[w * 8 + row]);
        float ll = 0.f, o = 0.f;
        if (mm != NEG_INF) {
            #pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float f = exp2f(sm_m[w * 8 + row] - mm);
                ll += sm_l[w * 8 + row] * f;
                o += sm_acc[(w * 8 + row) * D + ch] * f;
            }
        }
        const i64 part = ((i64)b * p.num_q_heads + head * p.group + row) * p.num_splits + split;
        p.o_part[part * D + ch] = ll > 0.f ? o / (ll * V_BOOST) : 0.f;
        if (ch == 0) p.lse_part[part] = ll > 0.f ? mm + log2f(ll) : NEG_INF;
    }
#if __CUDA_ARCH__ >= 900
    // Launched programmatically after the fp16 launch of the same walk (int8_mma.py), this grid may have started
    // before that one ended: it ends only after it, so the merge that follows finds both done. Otherwise a no-op.
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
