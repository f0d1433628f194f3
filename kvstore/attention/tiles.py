"""One tile of K/V for the paged decode kernel: table entries -> slots, fp16 rows, int8 rows as integers.

A row of entries is either the block table itself (direct) or partition.py's list of (slot, position in
the table) with one pool's blocks in a run. int8 tiles are never dequantized: they are converted to
fp16 integers (exact for -128..127) in the layout tl.dot wants (K loaded transposed, [D, N], straight
from memory) and the scales go into the small operands instead: K's per-channel scale into q
(q . (k * s) = (q * s) . k, one [G, D] product per block) and V's per-token scale into the
probabilities (sum_t p_t (v_t s_t) = sum_t (p_t s_t) v_t), both done by the caller (paged_decode._attend).

int8 -> fp16 without I2F (quarter rate on sm_90): fp16 with bits 0x64 | (x + 128) is 1152 + x, so 4
packed bytes become 4 fp16 by one xor, two byte permutes and two packed subtractions (USE_ASM, pack=4);
the plain-Triton cast is for the interpreter, which cannot run PTX.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def int8_to_fp16(x, USE_ASM: tl.constexpr):
    """int8 tensor (any shape) -> fp16, exactly."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, c;
            xor.b32 t, $2, 0x80808080;
            mov.b32 c, 0x64806480;
            prmt.b32 $0, t, 0x64646464, 0x4140;
            prmt.b32 $1, t, 0x64646464, 0x4342;
            sub.f16x2 $0, $0, c;
            sub.f16x2 $1, $1, c;
            }""",
            constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=True, pack=4,
        )
    return x.to(tl.float16)


@triton.jit
def entries(slot_row, pos_row, s_ent, idx, idx_hi, PARTITIONED: tl.constexpr):
    """Entries idx (any shape) of a row: slot int64, position in the original table, and idx < idx_hi.

    Direct: the row is the block table, position = idx. Partitioned: the row is partition.py's list.
    """
    ok = idx < idx_hi
    slot = tl.load(slot_row + idx * s_ent, mask=ok, other=0).to(tl.int64)
    if PARTITIONED:
        pos = tl.load(pos_row + idx * s_ent, mask=ok, other=0)
    else:
        pos = idx
    return slot, pos, ok


@triton.jit
def tile_tokens(slot_row, pos_row, is_int8_row, s_ent, s_i8_blk, j0, idx_hi, n_tok,
                BLOCK_TOKENS: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr,
                HAS_HOT: tl.constexpr, HAS_WARM: tl.constexpr, PARTITIONED: tl.constexpr):
    """Per token of entries j0 .. j0 + BLOCKS_PER_ITER: slot, index in its block, and which pool holds it.

    tok_ok: the token is one of the row's first n_tok. hot_ok / warm_ok: tok_ok and its block is in that
    pool (a one-pool build trusts that every flag names its pool).
    """
    offs_n = tl.arange(0, BLOCKS_PER_ITER * BLOCK_TOKENS)
    tok_idx = j0 + offs_n // BLOCK_TOKENS
    tok_in_blk = offs_n % BLOCK_TOKENS
    tok_slot, tok_pos, tok_ok = entries(slot_row, pos_row, s_ent, tok_idx, idx_hi, PARTITIONED)
    tok_ok &= tok_pos * BLOCK_TOKENS + tok_in_blk < n_tok  # [N]
    hot_ok = tok_ok
    warm_ok = tok_ok
    if HAS_HOT and HAS_WARM:
        tok_int8 = tl.load(is_int8_row + tok_idx * s_i8_blk, mask=tok_ok, other=0) != 0
        hot_ok = tok_ok & (tok_int8 == 0)
        warm_ok = tok_ok & tok_int8
    return tok_slot, tok_in_blk, tok_ok, hot_ok, warm_ok


@triton.jit
def load_hot(hot_ptr, tok_slot, tok_in_blk, hot_ok, head, s_hot_slot, s_hot_kv, s_hot_head, s_hot_tok,
             HEAD_DIM: tl.constexpr):
    """fp16 K and V [N, D] of the tile's hot tokens, 0 elsewhere."""
    rows = tok_slot * s_hot_slot + head * s_hot_head + tok_in_blk * s_hot_tok  # [N] int64
    ptrs = hot_ptr + rows[:, None] + tl.arange(0, HEAD_DIM)[None, :]  # [N, D]
    k = tl.load(ptrs, mask=hot_ok[:, None], other=0.0)
    v = tl.load(ptrs + s_hot_kv, mask=hot_ok[:, None], other=0.0)
    return k, v


@triton.jit
def load_warm(warm_ptr, v_scale_ptr, tok_slot, tok_in_blk, tok_ok, warm_ok, head,
              s_warm_slot, s_warm_kv, s_warm_head, s_warm_tok, s_vs_slot, s_vs_head,
              HEAD_DIM: tl.constexpr, USE_ASM: tl.constexpr, V_BOOST: tl.constexpr):
    """The tile's int8 tokens as fp16 integers, 0 elsewhere: K transposed [D, N], V [N, D]; v_mul f32 [N].

    v_mul: the token's v_scale * V_BOOST (int8), V_BOOST (hot), 0 (past the row). The boost keeps
    p * v_scale out of fp16's subnormals (finite while v_scale < 65504 / V_BOOST).
    """
    offs_d = tl.arange(0, HEAD_DIM)
    rows = tok_slot * s_warm_slot + head * s_warm_head + tok_in_blk * s_warm_tok  # [N] int64
    kt = tl.load(warm_ptr + rows[None, :] + offs_d[:, None], mask=warm_ok[None, :], other=0)  # [D, N] int8
    v = tl.load(warm_ptr + s_warm_kv + rows[:, None] + offs_d[None, :], mask=warm_ok[:, None], other=0)  # [N, D]
    v_scale = tl.load(v_scale_ptr + tok_slot * s_vs_slot + head * s_vs_head + tok_in_blk, mask=warm_ok, other=0.0)
    v_mul = tl.where(warm_ok, v_scale, tok_ok.to(tl.float32)) * V_BOOST
    return int8_to_fp16(kt, USE_ASM), int8_to_fp16(v, USE_ASM), v_mul


@triton.jit
def warm_scores(q, kt, k_scale_ptr, slot_row, pos_row, is_int8_row, s_ent, s_i8_blk, j0, idx_hi, head,
                s_ks_slot, s_ks_head,
                HEAD_DIM: tl.constexpr, BLOCK_TOKENS: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr,
                CHECK_FLAGS: tl.constexpr, PARTITIONED: tl.constexpr):
    """q . k over the tile's int8 tokens, f32 [M, N] (0 at other tokens): per block, (q * k_scale) . kt.

    k_scale is per (block, channel), so each block of the tile takes its own scaled q; with several
    blocks per tile each dot covers the whole tile and keeps its block's columns (extra tensor-core
    work, not extra bytes: the int8 default is one block per tile, see plan.py). q * k_scale is
    rounded to fp16, saturating at +-65504 (a channel with |q| * absmax(K) above 8.3e6; the score is
    then huge either way) and losing precision below 2^-14 (|q| * absmax(K) < 7.8e-3: contributes
    < 2^-25 * 127 per channel to the score).
    """
    offs_d = tl.arange(0, HEAD_DIM)
    s = tl.zeros([q.shape[0], BLOCKS_PER_ITER * BLOCK_TOKENS], tl.float32)
    for j in tl.static_range(BLOCKS_PER_ITER):
        slot, _, is_int8 = entries(slot_row, pos_row, s_ent, j0 + j, idx_hi, PARTITIONED)
        if CHECK_FLAGS:
            is_int8 &= tl.load(is_int8_row + (j0 + j) * s_i8_blk, mask=is_int8, other=0) != 0
        k_scale = tl.load(k_scale_ptr + slot * s_ks_slot + head * s_ks_head + offs_d, mask=(offs_d * 0 + is_int8.to(tl.int32)) != 0,
                          other=0.0)  # [D]
        q_scaled = tl.clamp(q.to(tl.float32) * k_scale[None, :], -65504.0, 65504.0).to(tl.float16)  # [M, D]
        if BLOCKS_PER_ITER == 1:
            s = tl.dot(q_scaled, kt)
        else:
            in_block = tl.arange(0, BLOCKS_PER_ITER * BLOCK_TOKENS) // BLOCK_TOKENS == j  # [N]
            s += tl.where(in_block[None, :], tl.dot(q_scaled, kt), 0.0)
    return s
