// The sketch selector's first level (eviction/sketch_channels.py's _channel_kernel) with the 4-bit codes
// decoded straight into tensor-core operand registers.
//
// What it computes is the Triton kernel's, per (q head, block): from the r channels the plan picked (largest
// sum |q| over the GQA group) the 4-bit estimate partial_t = q_R . min_R + sum_j code_tj fp16(q_j step_j) of
// every token, its log-sum-exp, and from every channel's min/max summaries Quest's bound on the unread
// channels; then lse (the ranking) and upper (a certified bound on the block's true log-sum-exp). The error
// analysis is the Triton kernel's, unchanged: codes are exact in fp16 (decoded to 0..15, not biased), the
// products fp16 x fp16 are exact in fp32, and q_j step_j is rounded to fp16 (with saturation) as there.
//
// Why not Triton: its dot takes the decoded codes through shared memory as an fp16 tile; at 1M tokens (llama3-8b
// geometry, r = 64) it takes 350 us and issues ~1,160 warp-instructions per block and kv head. Here each lane decodes
// exactly the nibbles its mma.sync fragments hold (~540 per block in the loop): 170 us, of which streaming the
// bytes alone takes ~157 (bench_longctx.sketch_bench; BENCHMARKS.md, Sketch selector). The rest of the gap to the
// copy ceiling is the gather: r code rows of T/2 = 32 bytes chosen among D cost ~1.5x their bytes, which the plan's
// adjacent pairs (sketch_plan.py) avoid. DRAM locality is not it: the plan's channels in ascending order (a warp's
// copy instruction walks each block's rows in address order) take 156 against 167 us, and other code layouts or
// copy shapes are slower (BENCHMARKS.md, Sketch selector).
//
// Work: a warp owns a tile of 16 consecutive blocks of one kv head; a program is WARPS warps of one kv head.
//   1. Per block, a cp.async ring (STAGES blocks deep) brings the block's r code rows (gathered by channel) into
//      shared memory, and its min / max rows into the tile buffer (16 rows, one per block of the tile).
//      The mma's K dimension is the read channels in the order rho = 16s + 4q' + j (k-step s, lane's slot
//      q' = 0..3, j = lane % 4), so that a lane's four rows per k-step sit in distinct banks; M is tokens: row n
//      (= lane / 4) of m-tile m is token 2(n MT + m) and row n + 8 the token after it, so the two nibbles of one
//      byte belong to one lane (low nibble: even token). A byte permute puts byte m of two rows into an fp16x2's
//      low bytes, a LOP3 ORs the nibble into 1024.0's mantissa and one HFMA2 takes 1024 off (the high nibble:
//      scaled by 1/16 first), exactly. B is fp16(q_j step_j) per block: the lanes first compute the block's r
//      steps (max - min) / 15 together into shared memory, each lane then scales its q values by the 4 steps of
//      each k-step. The warp reduces its tokens' estimates to a log-sum-exp per q head (butterfly shuffles over
//      the 8 row groups); the lanes that will hold that block's summary results keep it.
//   2. At the tile's end, its summaries from the tile buffer: min and max rows are the A operands (16 blocks =
//      the mma's M), q variants the B operands (N = the group's q heads): top_u, q_U . (min + max), Quest on R,
//      15 S_R, q_R . min_R and |q| . (|min| + |max|) as 11 mmas per 16 channels. A lane loads 8 contiguous
//      channels, so k-step 2c of 32-channel chunk c holds channels 32c + 8j + {0..3} and k-step 2c + 1 channels
//      + {4..7}; q is loaded the same way (a dot does not care about order).
//   3. Each lane writes lse and upper for its two blocks (n, n + 8) and two q heads (2j, 2j + 1).
// Compiled at run time with NVRTC (eviction/sketch_mma.py); includes only kvcuda/device.cuh.

#include "kvcuda/device.cuh"

struct Params {
    const u16* q; i64 s_q_head;                                   // fp16 [Hq, D], elements
    const u16* summ; i64 s_s_blk, s_s_minmax, s_s_head;           // fp16 [N, 2, H, D], elements
    const u8* codes; i64 s_c_blk, s_c_head;                       // uint8 channel rows [N, H, D, T / 2], bytes
    const int* channels; i64 s_ch_head;                           // int32 [H, R]: the channels read
    const u8* valid;                                              // bool [N], or null: every block
    float* lse; float* upper; i64 s_o_head;                       // float32 [Hq, N]
    float scale;
    int num_tokens, num_blocks, group;
};


#define LEVELS 15.0f
#define ROUNDING_SLACK 1e-4f
#define ABSOLUTE_SLACK 1e-5f
#define FP16_REL 4.8828125e-4f    // 2^-11
#define FP16_TINY 2.98023224e-8f  // 2^-25
#define FP16_MAX 65504.0f
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

__device__ __forceinline__ u32 pack_h2_sat(float lo, float hi) {  // round to nearest, saturate to +-65504
    u32 r;
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ u32 hmax2(u32 a, u32 b) {
    u32 r;
    asm("max.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

__device__ __forceinline__ u32 hmin2(u32 a, u32 b) {
    u32 r;
    asm("min.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

__device__ __forceinline__ float half_to_float(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// 0xFFFF in the fp16 lanes of channel pair `pair` (0..3) of an 8-bit channel mask, 0 elsewhere
__device__ __forceinline__ u32 pair_mask(u32 bits8, int pair) {
    return ((bits8 >> (2 * pair)) & 1u ? 0x0000ffffu : 0u) | ((bits8 >> (2 * pair + 1)) & 1u ? 0xffff0000u : 0u);
}

#define H2_ZERO 0u
#define H2_ABS 0x7fff7fffu
#define H2_SIGN 0x80008000u
#define H2_EXP_1024 0x64006400u     // fp16x2 (1024, 1024): a nibble ORed into its mantissa is 1024 + nibble
#define H2_MINUS_1024 0xe400e400u
#define H2_SIXTEENTH 0x2c002c00u    // fp16x2 (1/16, 1/16)
#define H2_ONE 0x3c003c00u
#define H2_MINUS_64 0xd400d400u

template <int D, int T, int R>
struct Geometry {
    static constexpr int MT = T / 16;               // m-tiles per block; code bytes per lane and row
    static constexpr int KR = R / 16;               // code k-steps
    static constexpr int ROW = T / 2;               // bytes of a code row (one channel, the block's tokens)
    static constexpr int CODE = R * ROW;            // a ring stage: the block's read rows, row rho at rho * ROW
    static constexpr int SROW = 4 * D + 16;         // a block's min row and max row (fp16) in the tile buffer, +16
                                                    // bytes (the once-a-tile fragment loads keep 2-way bank
                                                    // conflicts; a 64-byte pad would remove them, not measured)
    static constexpr int COPY = ROW < 16 ? ROW : 16;  // cp.async piece of a code row
    static constexpr int CODE_PIECES = CODE / COPY;
    static constexpr int HEADER = (4 * R + 4 * (D / 32) + 15) / 16 * 16;  // channels, read mask
};

template <int D, int T, int R, int WARPS, int STAGES>
__device__ __forceinline__ void sketch_first_level_body(const Params& p) {
    using G = Geometry<D, T, R>;
    constexpr int MT = G::MT, KR = G::KR, ROW = G::ROW;
    constexpr int CP = (G::CODE_PIECES + 31) / 32;  // code pieces per lane and block
    constexpr int RL = (R + 31) / 32;               // read channels whose step a lane computes: rho = lane + 32 i
    static_assert(R % 16 == 0 && R <= D && D % 32 == 0, "r a multiple of 16, at most head_dim");
    static_assert(MT == 1 || MT == 2 || MT == 4 || MT == 8, "block_tokens 16, 32, 64 or 128");
    extern __shared__ __align__(16) unsigned char smem[];
    int* chan = reinterpret_cast<int*>(smem);                     // [R] the read channels, plan order
    u32* readbits = reinterpret_cast<u32*>(smem + 4 * R);         // [D / 32] bit per channel: read
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n = lane >> 2, j = lane & 3;
    const int head = blockIdx.y, group = p.group;
    constexpr int WARP_BYTES = STAGES * G::CODE + 16 * G::SROW + 2 * 4 * R;  // sketch_mma.py's smem_bytes mirrors
    unsigned char* ring = smem + G::HEADER + warp * WARP_BYTES;    // STAGES blocks' code rows
    unsigned char* tilebuf = ring + STAGES * G::CODE;              // the tile's 16 blocks' min / max rows
    float* stepbuf = reinterpret_cast<float*>(tilebuf + 16 * G::SROW);  // [2][R], by k-step slot order

    for (int i = threadIdx.x; i < D / 32; i += blockDim.x) readbits[i] = 0u;
    __syncthreads();
    for (int i = threadIdx.x; i < R; i += blockDim.x) {
        const int c = p.channels[head * p.s_ch_head + i];
        chan[i] = c;
        atomicOr(&readbits[c >> 5], 1u << (c & 31));
    }
    __syncthreads();

    // per warp, for all its tiles: q (this lane's column is q head n), the read channels' q values at k-step s,
    // slot q' (channel rho = 16s + 4q' + j) as fp32, the steps this lane computes, its code pieces
    const bool q_ok = n < group;
    const u16* q_row = p.q + (i64)(head * group + (q_ok ? n : 0)) * p.s_q_head;
    float qv[KR][4];
    #pragma unroll
    for (int s = 0; s < KR; ++s)
        #pragma unroll
        for (int k = 0; k < 4; ++k) qv[s][k] = q_ok ? half_to_float(q_row[chan[16 * s + 4 * k + j]]) : 0.f;
    int my_ch[RL], my_slot[RL];
    #pragma unroll
    for (int i = 0; i < RL; ++i) {
        const int rho = lane + 32 * i;
        my_ch[i] = rho < R ? chan[rho] : 0;
        my_slot[i] = (rho / 16) * 16 + (rho % 4) * 4 + (rho % 16) / 4;  // stepbuf order: 16s + 4j + q'
    }
    int src_off[CP];
    #pragma unroll
    for (int i = 0; i < CP; ++i) {
        const int piece = lane + 32 * i;
        const int rho = piece / (ROW / G::COPY), part = piece % (ROW / G::COPY);
        src_off[i] = piece < G::CODE_PIECES ? chan[rho] * ROW + part * G::COPY : 0;
    }
    const u8* code_head = p.codes + head * p.s_c_head;
    const u16* summ_head = p.summ + head * p.s_s_head;
    const float l2 = p.scale * LOG2E;
    const int n_tiles = (p.num_blocks + 15) / 16;

    for (int tile = blockIdx.x * WARPS + warp; tile < n_tiles; tile += gridDim.x * WARPS) {
        const int b0 = tile * 16, n_tile = min(16, p.num_blocks - b0);
        // the tile's live blocks, one bit each (valid read once, not on every block's critical path)
        const u32 live_bits = __ballot_sync(0xffffffffu, lane < n_tile && (p.valid == nullptr || p.valid[b0 + lane]));
        auto issue = [&](int t) {  // block b0 + t: code rows -> ring stage t % STAGES, min / max rows -> tile row t
            if (t < n_tile) {
                const i64 blk = b0 + t;
                unsigned char* dst = ring + (t % STAGES) * G::CODE;
                const u8* src = code_head + blk * p.s_c_blk;
                #pragma unroll
                for (int i = 0; i < CP; ++i) {
                    const int piece = lane + 32 * i;
                    if (G::CODE_PIECES % 32 == 0 || piece < G::CODE_PIECES) {
                        if constexpr (G::COPY == 16) cp_async16(dst + piece * 16, src + src_off[i]);
                        else cp_async8(dst + piece * 8, src + src_off[i]);
                    }
                }
                if (lane < D / 4) {  // min row then max row, 16 bytes a lane
                    const int which = lane / (D / 8), part = lane % (D / 8);
                    cp_async16(tilebuf + t * G::SROW + lane * 16,
                               summ_head + blk * p.s_s_blk + which * p.s_s_minmax + part * 8);
                }
            }
            cp_async_commit();
        };
        #pragma unroll
        for (int t = 0; t < STAGES - 1; ++t) issue(t);

        // ---- 1. per block: the read channels' estimates, reduced to a log-sum-exp per q head
        float lse_keep[2][2] = {{NEG_INF, NEG_INF}, {NEG_INF, NEG_INF}};  // blocks n, n + 8; heads 2j, 2j + 1
        for (int t = 0; t < n_tile; ++t) {
            issue(t + STAGES - 1);
            cp_async_wait<STAGES - 1>();
            __syncwarp();
            if ((live_bits >> t) & 1u) {
                const unsigned char* st = ring + (t % STAGES) * G::CODE;
                const u16* smin = reinterpret_cast<const u16*>(tilebuf + t * G::SROW);
                float* steps = stepbuf + (t & 1) * R;
                #pragma unroll
                for (int i = 0; i < RL; ++i)
                    if (lane + 32 * i < R)
                        steps[my_slot[i]] =
                            (half_to_float(smin[D + my_ch[i]]) - half_to_float(smin[my_ch[i]])) / LEVELS;
                __syncwarp();
                float acc[MT][4];
                #pragma unroll
                for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.f;
                #pragma unroll
                for (int s = 0; s < KR; ++s) {
                    const float4 sv = *reinterpret_cast<const float4*>(steps + 16 * s + 4 * j);
                    const u32 b0 = pack_h2_sat(qv[s][0] * sv.x, qv[s][1] * sv.y);  // k rows 2j, 2j + 1: slots 0, 1
                    const u32 b1 = pack_h2_sat(qv[s][2] * sv.z, qv[s][3] * sv.w);  // k rows 2j + 8, 2j + 9: 2, 3
                    u32 w[4][(MT + 3) / 4];  // the 4 rows' bytes of this lane: pairs n MT .. n MT + MT - 1
                    #pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        const unsigned char* row = st + (16 * s + 4 * k + j) * ROW + n * MT;
                        if constexpr (MT == 8) {
                            const uint2 x = *reinterpret_cast<const uint2*>(row);
                            w[k][0] = x.x; w[k][1] = x.y;
                        } else if constexpr (MT == 4) {
                            w[k][0] = *reinterpret_cast<const u32*>(row);
                        } else if constexpr (MT == 2) {
                            w[k][0] = *reinterpret_cast<const u16*>(row);
                        } else {
                            w[k][0] = *row;
                        }
                    }
                    #pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        const u32 sel = (m & 3) | ((m & 3) << 4) | ((4 + (m & 3)) << 8) | ((4 + (m & 3)) << 12);
                        const u32 p01 = prmt(w[0][m >> 2], w[1][m >> 2], sel);  // byte m of rows 0, 1 in bytes 0, 2
                        const u32 p23 = prmt(w[2][m >> 2], w[3][m >> 2], sel);
                        const u32 a0 = hfma2((p01 & 0x000f000fu) | H2_EXP_1024, H2_ONE, H2_MINUS_1024);  // even
                        const u32 a1 = hfma2((p01 & 0x00f000f0u) | H2_EXP_1024, H2_SIXTEENTH, H2_MINUS_64);  // odd
                        const u32 a2 = hfma2((p23 & 0x000f000fu) | H2_EXP_1024, H2_ONE, H2_MINUS_1024);
                        const u32 a3 = hfma2((p23 & 0x00f000f0u) | H2_EXP_1024, H2_SIXTEENTH, H2_MINUS_64);
                        mma(acc[m], a0, a1, a2, a3, b0, b1);
                    }
                }
                // the block's log-sum-exp per q head (columns 2j, 2j + 1) over its real tokens; rows n, n + 8 of
                // m-tile m are tokens 2 (n MT + m) and the one after
                const int real = min(T, p.num_tokens - (b0 + t) * T);
                float top[2] = {NEG_INF, NEG_INF};
                #pragma unroll
                for (int m = 0; m < MT; ++m) {
                    const int tok = 2 * (n * MT + m);
                    if (real == T || tok < real) {
                        top[0] = fmaxf(top[0], acc[m][0]);
                        top[1] = fmaxf(top[1], acc[m][1]);
                    }
                    if (real == T || tok + 1 < real) {
                        top[0] = fmaxf(top[0], acc[m][2]);
                        top[1] = fmaxf(top[1], acc[m][3]);
                    }
                }
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    top[h] = fmaxf(top[h], __shfl_xor_sync(0xffffffffu, top[h], 4));
                    top[h] = fmaxf(top[h], __shfl_xor_sync(0xffffffffu, top[h], 8));
                    top[h] = fmaxf(top[h], __shfl_xor_sync(0xffffffffu, top[h], 16));
                    top[h] = top[h] == NEG_INF ? 0.f : top[h] * l2;  // no real token: the sum below is 0
                }
                float sum[2] = {0.f, 0.f};
                #pragma unroll
                for (int m = 0; m < MT; ++m) {
                    const int tok = 2 * (n * MT + m);
                    #pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        if (real == T || tok < real) sum[h] += exp2f(fmaf(acc[m][h], l2, -top[h]));
                        if (real == T || tok + 1 < real) sum[h] += exp2f(fmaf(acc[m][2 + h], l2, -top[h]));
                    }
                }
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 4);
                    sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 8);
                    sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 16);
                    const float lp = (top[h] + log2f(sum[h])) * LN2;
                    if (t == n) lse_keep[0][h] = lp;
                    if (t == n + 8) lse_keep[1][h] = lp;
                }
            }
            __syncwarp();  // every lane is done with this stage before the next iteration refills it
        }
        cp_async_wait<0>();
        __syncwarp();

        // ---- 2. the tile's summaries from the tile buffer: rows = blocks b0 + n (c0, c1) and b0 + n + 8 (c2, c3),
        // columns = q heads; rows past the tile hold stale bytes and are never written out
        float acc_top[4] = {0.f, 0.f, 0.f, 0.f};     // top_u = max . u+ + min . u-
        float acc_mid[4] = {0.f, 0.f, 0.f, 0.f};     // q_U . (min + max)
        float acc_quest[4] = {0.f, 0.f, 0.f, 0.f};   // quest_r = max . r+ + min . r-
        float acc_spread[4] = {0.f, 0.f, 0.f, 0.f};  // 15 S_R = (max - min) . |q_R|
        float acc_base[4] = {0.f, 0.f, 0.f, 0.f};    // q_R . min
        float acc_size[4] = {0.f, 0.f, 0.f, 0.f};    // |q| . (|min| + |max|)
        const unsigned char* s0 = tilebuf + n * G::SROW + 16 * j;
        const unsigned char* s1 = s0 + 8 * G::SROW;
        #pragma unroll
        for (int c = 0; c < D / 32; ++c) {
            const uint4 mn0 = *reinterpret_cast<const uint4*>(s0 + 64 * c);
            const uint4 mn1 = *reinterpret_cast<const uint4*>(s1 + 64 * c);
            const uint4 mx0 = *reinterpret_cast<const uint4*>(s0 + 2 * D + 64 * c);
            const uint4 mx1 = *reinterpret_cast<const uint4*>(s1 + 2 * D + 64 * c);
            const uint4 qx = q_ok ? *reinterpret_cast<const uint4*>(q_row + 32 * c + 8 * j)
                                  : make_uint4(0u, 0u, 0u, 0u);
            const u32 bits = (readbits[c] >> (8 * j)) & 0xffu;
            const u32 amn0[4] = {mn0.x, mn0.y, mn0.z, mn0.w}, amn1[4] = {mn1.x, mn1.y, mn1.z, mn1.w};
            const u32 amx0[4] = {mx0.x, mx0.y, mx0.z, mx0.w}, amx1[4] = {mx1.x, mx1.y, mx1.z, mx1.w};
            const u32 aq[4] = {qx.x, qx.y, qx.z, qx.w};
            #pragma unroll
            for (int e = 0; e < 2; ++e) {  // k-step 2c + e: channel pairs 2e (b0's rows) and 2e + 1 (b1's)
                u32 q_r[2], q_u[2];
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const u32 m = pair_mask(bits, 2 * e + h);
                    q_r[h] = aq[2 * e + h] & m;
                    q_u[h] = aq[2 * e + h] & ~m;
                }
                const u32 mn[4] = {amn0[2 * e], amn1[2 * e], amn0[2 * e + 1], amn1[2 * e + 1]};
                const u32 mx[4] = {amx0[2 * e], amx1[2 * e], amx0[2 * e + 1], amx1[2 * e + 1]};
                mma(acc_top, mx[0], mx[1], mx[2], mx[3], hmax2(q_u[0], H2_ZERO), hmax2(q_u[1], H2_ZERO));
                mma(acc_top, mn[0], mn[1], mn[2], mn[3], hmin2(q_u[0], H2_ZERO), hmin2(q_u[1], H2_ZERO));
                mma(acc_mid, mx[0], mx[1], mx[2], mx[3], q_u[0], q_u[1]);
                mma(acc_mid, mn[0], mn[1], mn[2], mn[3], q_u[0], q_u[1]);
                mma(acc_quest, mx[0], mx[1], mx[2], mx[3], hmax2(q_r[0], H2_ZERO), hmax2(q_r[1], H2_ZERO));
                mma(acc_quest, mn[0], mn[1], mn[2], mn[3], hmin2(q_r[0], H2_ZERO), hmin2(q_r[1], H2_ZERO));
                const u32 ar0 = q_r[0] & H2_ABS, ar1 = q_r[1] & H2_ABS;
                mma(acc_spread, mx[0], mx[1], mx[2], mx[3], ar0, ar1);
                mma(acc_spread, mn[0], mn[1], mn[2], mn[3], ar0 | H2_SIGN, ar1 | H2_SIGN);
                mma(acc_base, mn[0], mn[1], mn[2], mn[3], q_r[0], q_r[1]);
                const u32 aq0 = aq[2 * e] & H2_ABS, aq1 = aq[2 * e + 1] & H2_ABS;
                mma(acc_size, mn[0] & H2_ABS, mn[1] & H2_ABS, mn[2] & H2_ABS, mn[3] & H2_ABS, aq0, aq1);
                mma(acc_size, mx[0] & H2_ABS, mx[1] & H2_ABS, mx[2] & H2_ABS, mx[3] & H2_ABS, aq0, aq1);
            }
        }
        __syncwarp();  // the tile buffer is read; the next tile's copies may land

        // ---- 3. lse and upper for blocks b0 + n + 8 rr, q heads 2j + h (slot c = 2 rr + h):
        // lse = L + (base + mid / 2) scale; upper = min(L + (base + top_u + err + slack) scale,
        // log n_b + (top_u + quest_r + slack) scale) + 1e-5, Quest's bound alone where q_j step_j could leave fp16
        #pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const int blk = b0 + n + 8 * rr;
            if (blk >= p.num_blocks) continue;
            const bool live = (live_bits >> (n + 8 * rr)) & 1u;
            const float n_real = fminf(fmaxf((float)(p.num_tokens - blk * T), 0.f), (float)T);
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int qh = 2 * j + h, c = 2 * rr + h;
                if (qh >= group) continue;
                const float spread = acc_spread[c] / LEVELS, slack = ROUNDING_SLACK * acc_size[c];
                const float err = 0.5f * spread + LEVELS * (FP16_REL * spread + R * LEVELS * FP16_TINY);
                const float l = lse_keep[rr][h];
                const float cap = logf(n_real) + (acc_top[c] + acc_quest[c] + slack) * p.scale;
                const float up = acc_size[c] < LEVELS * FP16_MAX
                                 ? fminf(l + (acc_base[c] + acc_top[c] + err + slack) * p.scale, cap) : cap;
                const i64 out = (i64)(head * group + qh) * p.s_o_head + blk;
                p.lse[out] = live ? l + (acc_base[c] + 0.5f * acc_mid[c]) * p.scale : NEG_INF;
                p.upper[out] = live ? up + ABSOLUTE_SLACK : NEG_INF;
            }
        }
    }
}
