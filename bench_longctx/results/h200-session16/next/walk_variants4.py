"""Planned in session 16 (no device time left to run it): the int8 walk's V operands read with ldmatrix.trans.

Today (session 16's shipped decode) a 16-token tile's V costs 4 ld.shared.v4 of two tokens' rows each, then per
pair of A registers one PRMT gathering two tokens' bytes and two interleaving them with 0x64: 64 instructions.
With `ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16` over the swizzled rows (a b16 element = two channels of a
token), lane 4r + c receives tokens 2c and 2c + 1 of channel pair r of a 16-byte piece: the gather is done by the
load. One PRMT then makes each A register (channel 2r or 2r + 1 against 1152, tokens 2c, 2c + 1): 4 ldmatrix,
16 xors and 32 PRMTs a tile (52). The m-tiles become the 16-byte pieces (m-tile e: channels 16e + 2r and + 1 in
rows r and r + 8), so the epilogue's channel of acc[e][i] is 16e + 2r + (i >> 1).

    v_ldsm   the above; outputs must equal the shipped kernel's bit for bit (the same fp16 operands, the same
             mma sums, channels permuted only in registers)

Session 15's harness (walk_variants.py): each variant against the shipped kernel in one process, times alternated.

    python bench_longctx/results/h200-session16/next/walk_variants4.py OUT_DIR | --compile
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "walk_variants", Path(__file__).parents[2] / "h200-session15" / "walk_variants.py")
wv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wv)

V_AT = """    u32 v_at[2];  // V: rows 2c + j (+ 8 (x >> 1) + 16v), bytes r * D/8 ..
    #pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int row = 2 * c + j, byte = r * (D / 8);
        v_at[j] = G::V_OFF + row * ROW + 16 * ((byte / 16) ^ (row % G::PIECES)) + byte % 16;
    }
"""
V_LD = """    u32 v_ld[VM / 2];  // V for ldmatrix: lane L's row, token (L & 7) + 8 ((L >> 3) & 1) (+ 16v), piece 2E + (L >> 4)
    #pragma unroll
    for (int E = 0; E < VM / 2; ++E) {
        const int row = (lane & 7) + 8 * ((lane >> 3) & 1), piece = 2 * E + (lane >> 4);
        v_ld[E] = G::V_OFF + row * ROW + 16 * (piece ^ (row % G::PIECES));
    }
"""

V_DECODE = """            // V: words biased once, then per register pair one gather of both tokens' bytes and two interleaves
            // with 0x64 (a mask and a bias per register cost 50% more instructions: results/h200-session16)
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
"""
V_LDSM = """            #pragma unroll
            for (int E = 0; E < VM / 2; ++E) {  // m-tiles 2E, 2E + 1: pieces 2E, 2E + 1 (rows r, r + 8: channels 2r, 2r + 1)
                u32 d[4];  // tokens 2c, 2c + 1 (d[0], d[2]) and 2c + 8, 2c + 9 (d[1], d[3]) of the tile, channel pair r
                ldsm_x4_trans(d, st + v_ld[E] + 16 * v * ROW);
                #pragma unroll
                for (int j = 0; j < 4; ++j) d[j] ^= 0x80808080u;  // 128 + V
                #pragma unroll
                for (int half = 0; half < 2; ++half)
                    mma(acc[2 * E + half],
                        __byte_perm(d[2 * half], 0x64646464u, 0x5240), __byte_perm(d[2 * half], 0x64646464u, 0x5341),
                        __byte_perm(d[2 * half + 1], 0x64646464u, 0x5240),
                        __byte_perm(d[2 * half + 1], 0x64646464u, 0x5341), pt[0], pt[1]);  // 1152 + V
            }
"""
EPILOGUE = """        for (int i = 0; i < 4; ++i)  // head 2c + (i & 1), channel r * D/8 + 2e + (i >> 1)
            sm_acc[(warp * 8 + 2 * c + (i & 1)) * D + r * (D / 8) + 2 * e + (i >> 1)] = acc[e][i] - corr[i & 1];
"""
EPILOGUE_LDSM = """        for (int i = 0; i < 4; ++i)  // head 2c + (i & 1), channel 16e + 2r + (i >> 1)
            sm_acc[(warp * 8 + 2 * c + (i & 1)) * D + 16 * e + 2 * r + (i >> 1)] = acc[e][i] - corr[i & 1];
"""
LDSM = """__device__ __forceinline__ void ldsm_x4_trans(u32 (&d)[4], u32 a) {  // a: a shared-space address
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(a) : "memory");
}

template <int D, int T>
struct Geometry {"""


def v_ldsm(src: str) -> str:
    src = wv._sub(src, V_AT, V_LD)
    src = wv._sub(src, V_DECODE, V_LDSM)
    src = wv._sub(src, EPILOGUE, EPILOGUE_LDSM)
    return wv._sub(src, "template <int D, int T>\nstruct Geometry {", LDSM)


wv.VARIANTS = {
    "base": (lambda s: s, 2, 3, 32),
    "v_ldsm": (v_ldsm, 2, 3, 32),
}

if __name__ == "__main__":
    wv.main()
