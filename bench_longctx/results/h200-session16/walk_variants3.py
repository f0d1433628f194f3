"""Session 16: the int8 walk's V decode in fewer instructions (session 15's harness, walk_variants.py: each variant
against the shipped kernel in the same process, outputs compared, times alternated). In the shipped kernel a V
operand register costs a PRMT and two LOP3s (the compiler splits (x & 0x00ff00ff) ^ 0x64806480, two immediates,
into two): 192 of the ~850 instructions of the loop's SASS (sm_90, NVRTC) for V, 96 for K.

    v_prmt   V words biased once (xor 0x80808080), then per pair of registers one PRMT gathering both tokens' bytes
             of two channels and two PRMTs interleaving them with 0x64: 64 instructions a 16-token tile, not 96
    v_lop3   the shipped gather, the mask and the bias in one LOP3 (the constant in an opaque register)

Both produce the shipped kernel's fp16 operands bit for bit: outputs must be equal (max_abs 0). The edits match
int8_mma.cu as of tree f4216a7; call 7 measured v_prmt 0.5-1.5% faster and it became the shipped decode.

    python bench_longctx/results/h200-session16/walk_variants3.py OUT_DIR | --compile
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "walk_variants", Path(__file__).parents[1] / "h200-session15" / "walk_variants.py")
wv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wv)

SHIPPED = """            u32 vw[4][VW];  // tokens 16v + 2c + {0, 1, 8, 9}, channels r * D/8 ..
            #pragma unroll
            for (int x = 0; x < 4; ++x) lds_words(vw[x], st + v_at[x & 1] + (16 * v + 8 * (x >> 1)) * ROW);
            #pragma unroll
            for (int e = 0; e < VM; ++e) {  // channels 2e, 2e + 1 of the thread's D/8: word e / 2, bytes 2(e % 2) ..
                const int w = e / 2, k = 2 * (e % 2);
                const int s0_ = k | ((4 + k) << 8), s1_ = (k + 1) | ((5 + k) << 8);
                mma(acc[e],
                    (__byte_perm(vw[0][w], vw[1][w], s0_) & 0x00ff00ffu) ^ 0x64806480u,  // 1152 + V
                    (__byte_perm(vw[0][w], vw[1][w], s1_) & 0x00ff00ffu) ^ 0x64806480u,
                    (__byte_perm(vw[2][w], vw[3][w], s0_) & 0x00ff00ffu) ^ 0x64806480u,
                    (__byte_perm(vw[2][w], vw[3][w], s1_) & 0x00ff00ffu) ^ 0x64806480u, pt[0], pt[1]);
            }
"""

V_PRMT = """            u32 vw[4][VW];  // tokens 16v + 2c + {0, 1, 8, 9}, channels r * D/8 .., as 128 + V
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
"""

V_LOP3 = """            u32 vw[4][VW];  // tokens 16v + 2c + {0, 1, 8, 9}, channels r * D/8 ..
            #pragma unroll
            for (int x = 0; x < 4; ++x) lds_words(vw[x], st + v_at[x & 1] + (16 * v + 8 * (x >> 1)) * ROW);
            #pragma unroll
            for (int e = 0; e < VM; ++e) {  // channels 2e, 2e + 1 of the thread's D/8: word e / 2, bytes 2(e % 2) ..
                const int w = e / 2, k = 2 * (e % 2);
                const int s0_ = k | ((4 + k) << 8), s1_ = (k + 1) | ((5 + k) << 8);
                mma(acc[e],
                    mask_bias(__byte_perm(vw[0][w], vw[1][w], s0_), magic),  // 1152 + V
                    mask_bias(__byte_perm(vw[0][w], vw[1][w], s1_), magic),
                    mask_bias(__byte_perm(vw[2][w], vw[3][w], s0_), magic),
                    mask_bias(__byte_perm(vw[2][w], vw[3][w], s1_), magic), pt[0], pt[1]);
            }
"""

MASK_BIAS = """__device__ __forceinline__ u32 mask_bias(u32 x, u32 magic) {  // (x & 0x00ff00ff) ^ magic in one LOP3
    u32 y;
    asm("lop3.b32 %0, %1, 0x00ff00ff, %2, 0x6a;" : "=r"(y) : "r"(x), "r"(magic));
    return y;
}

template <int D, int T>
struct Geometry {"""


def v_prmt(src: str) -> str:
    return wv._sub(src, SHIPPED, V_PRMT)


def v_lop3(src: str) -> str:
    src = wv._sub(src, SHIPPED, V_LOP3)
    src = wv._sub(src, "template <int D, int T>\nstruct Geometry {", MASK_BIAS)
    return wv._sub(src, "    const float qk = p.qk_scale;",
                   '    u32 magic = 0x64806480u;\n    asm volatile("" : "+r"(magic));  // opaque: stays a register\n'
                   "    const float qk = p.qk_scale;")


wv.VARIANTS = {
    "base": (lambda s: s, 2, 3, 32),
    "v_prmt": (v_prmt, 2, 3, 32),
    "v_lop3": (v_lop3, 2, 3, 32),
}

if __name__ == "__main__":
    wv.main()
