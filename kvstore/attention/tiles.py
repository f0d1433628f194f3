"""One tile of K/V for the paged decode kernel: table entries -> slots, fp16 rows, warm rows dequantized.

A row of entries is either the block table itself (direct) or partition.py's list of (slot, position in
the table) with one pool's blocks in a run. Warm blocks are read as int32 words and decoded in registers,
exactly (unpack.py: int8, fp8 e4m3, int4 codes); int8 and fp8 scale K per (block, channel) and V per token,
int4 adds a zero per group (K: K_GROUP tokens, V: V_GROUP channels; tiers/quant.py), each (scale, zero)
loaded once per group and broadcast in registers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvstore.attention.unpack import fp8_words_to_fp16, nibble_words_to_fp16, words_to_fp16


@triton.jit
def launch_dependents():
    """griddepcontrol.launch_dependents (sm_90+): a kernel launched programmatically after this one may start its
    programs once every program of this one has run this (or ended). A no-op for launches that are not."""
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)


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
def load_warm_k(
    warm_ptr, k_scale_ptr, slot_row, pos_row, is_int8_row, s_ent, s_i8_blk, j0, idx_hi, n_tok, head,
    s_warm_slot, s_warm_head, s_warm_tok, s_ks_slot, s_ks_head,
    HEAD_DIM: tl.constexpr, BLOCK_TOKENS: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr,
    CHECK_FLAGS: tl.constexpr, PARTITIONED: tl.constexpr, USE_ASM: tl.constexpr,
    WARM_FORMAT: tl.constexpr, K_GROUP: tl.constexpr,
):
    """Dequantized K of the warm blocks among entries j0 .. j0 + BLOCKS_PER_ITER, fp16 [N, D], 0 in other entries.

    int8 / fp8: K's scale is per (block, channel), so K is loaded per block and the scale broadcasts over its
    tokens. It is applied in fp16: exact to rounding unless a channel's absmax is < 2^-7 (scale in
    fp16's subnormals), where the channel adds next to nothing to q.k anyway. int4: code * scale + zero per
    (block, group of K_GROUP tokens, channel), in fp16.
    """
    blk = j0 + tl.arange(0, BLOCKS_PER_ITER)  # [J]
    slot, pos, is_int8 = entries(slot_row, pos_row, s_ent, blk, idx_hi, PARTITIONED)
    if CHECK_FLAGS:
        is_int8 &= tl.load(is_int8_row + blk * s_i8_blk, mask=blk < idx_hi, other=0) != 0
    offs_t = tl.arange(0, BLOCK_TOKENS)
    offs_d = tl.arange(0, HEAD_DIM)
    n: tl.constexpr = BLOCKS_PER_ITER * BLOCK_TOKENS
    mask = (pos[:, None] * BLOCK_TOKENS + offs_t[None, :] < n_tok) & is_int8[:, None]  # [J, T]
    base = slot * s_warm_slot + head * s_warm_head  # [J] int64
    rows = base[:, None, None] + offs_t[None, :, None] * s_warm_tok  # [J, T, 1]
    ks_row = k_scale_ptr + (slot * s_ks_slot + head * s_ks_head)[:, None]  # [J, 1]
    if WARM_FORMAT == 2:  # int4: 8 codes a word; (scale, zero) per token group, the zeros half a slot after
        offs_w = tl.arange(0, HEAD_DIM // 8)
        codes = tl.load(warm_ptr + rows + offs_w[None, None, :], mask=mask[:, :, None], other=0)
        groups: tl.constexpr = BLOCK_TOKENS // K_GROUP  # each (scale, zero) read once, broadcast over its tokens
        k = tl.reshape(nibble_words_to_fp16(codes, USE_ASM), [BLOCKS_PER_ITER, groups, BLOCK_TOKENS // groups,
                                                                HEAD_DIM])
        ptrs = ks_row[:, :, None] + tl.arange(0, groups)[None, :, None] * HEAD_DIM + offs_d[None, None, :]
        k_scale = tl.load(ptrs, mask=is_int8[:, None, None], other=0.0)  # [J, G, D]
        k_zero = tl.load(ptrs + s_ks_slot // 2, mask=is_int8[:, None, None], other=0.0)
        # tokens past n_tok in a warm block read code 0 (= k_zero): finite, and the caller masks their scores
        return tl.reshape(k * k_scale[:, :, None, :] + k_zero[:, :, None, :], [n, HEAD_DIM])
    offs_w = tl.arange(0, HEAD_DIM // 4)
    words = tl.load(warm_ptr + rows + offs_w[None, None, :], mask=mask[:, :, None], other=0)
    if WARM_FORMAT == 1:  # fp8: 4 e4m3 a word
        k = fp8_words_to_fp16(words, USE_ASM)
    else:  # int8: 4 bytes a word
        k = words_to_fp16(words, USE_ASM)
    k = tl.reshape(k, [BLOCKS_PER_ITER, BLOCK_TOKENS, HEAD_DIM])
    k_scale = tl.load(ks_row + offs_d[None, :], mask=is_int8[:, None], other=0.0).to(tl.float16)  # [J, D]
    return tl.reshape(k * k_scale[:, None, :], [n, HEAD_DIM])


@triton.jit
def token_entries(
    slot_row, pos_row, is_int8_row, s_ent, s_i8_blk, j0, idx_hi, n_tok,
    BLOCK_TOKENS: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr, HAS_HOT: tl.constexpr, HAS_WARM: tl.constexpr,
    PARTITIONED: tl.constexpr,
):
    """Per token of entries j0 .. j0 + BLOCKS_PER_ITER, what load_kv_at takes: slot int64 [N], tok_ok [N] (the
    entry is below idx_hi and the token one of the row's first n_tok) and tok_int8 [N] (read only with both pools:
    else tok_ok)."""
    n: tl.constexpr = BLOCKS_PER_ITER * BLOCK_TOKENS
    offs_n = tl.arange(0, n)
    tok_idx = j0 + offs_n // BLOCK_TOKENS
    tok_slot, tok_pos, tok_ok = entries(slot_row, pos_row, s_ent, tok_idx, idx_hi, PARTITIONED)
    tok_ok &= tok_pos * BLOCK_TOKENS + offs_n % BLOCK_TOKENS < n_tok  # [N]
    tok_int8 = tok_ok
    if HAS_HOT and HAS_WARM:
        tok_int8 = tl.load(is_int8_row + tok_idx * s_i8_blk, mask=tok_ok, other=0) != 0
    return tok_slot, tok_ok, tok_int8


@triton.jit
def load_kv_at(
    hot_ptr, warm_ptr, k_scale_ptr, v_scale_ptr, slot_row, pos_row, is_int8_row, s_ent, s_i8_blk,
    j0, idx_hi, n_tok, head, tok_slot, tok_ok, tok_int8,
    s_hot_slot, s_hot_kv, s_hot_head, s_hot_tok,
    s_warm_slot, s_warm_kv, s_warm_head, s_warm_tok,
    s_ks_slot, s_ks_head, s_vs_slot, s_vs_head,
    HEAD_DIM: tl.constexpr, BLOCK_TOKENS: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr,
    HAS_HOT: tl.constexpr, HAS_WARM: tl.constexpr, PARTITIONED: tl.constexpr, USE_ASM: tl.constexpr,
    V_BOOST: tl.constexpr, WARM_FORMAT: tl.constexpr, K_GROUP: tl.constexpr, V_GROUP: tl.constexpr,
):
    """Entries j0 .. j0 + BLOCKS_PER_ITER of one kv head, given their per-token slot int64 [N], tok_ok [N] and
    tok_int8 [N] (read only with both pools; token_entries, or loads a caller issues before it knows the row's
    length): k, v fp16 [N, D] (0 where tok_ok is not) and v_mul f32 [N].

    K = k. V = v * v_mul / V_BOOST: int8 (fp8) blocks keep their integer (e4m3) values in v and their per-token
    scale in v_mul, which the caller folds into the probabilities (fp16 and int4 blocks: v_mul = V_BOOST, int4's
    V dequantized here: its (scale, zero) vary along the channels).
    The boost keeps p * v_scale out of fp16's subnormals. Without HAS_WARM v_mul is unused.
    The per-block entries (int8 K's slots and scales) are loaded here, bounded by idx_hi; they hit the
    cache lines the per-token ones brought in.
    """
    n: tl.constexpr = BLOCKS_PER_ITER * BLOCK_TOKENS
    offs_d = tl.arange(0, HEAD_DIM)
    tok_in_blk = tl.arange(0, n) % BLOCK_TOKENS
    k = tl.zeros([n, HEAD_DIM], tl.float16)
    v = tl.zeros([n, HEAD_DIM], tl.float16)
    v_mul = tl.full([n], V_BOOST, tl.float32)
    hot_ok = tok_ok  # a pure build trusts that every flag names its pool
    warm_ok = tok_ok
    if HAS_HOT and HAS_WARM:
        hot_ok = tok_ok & (tok_int8 == 0)
        warm_ok = tok_ok & tok_int8
    if HAS_HOT:
        rows = tok_slot * s_hot_slot + head * s_hot_head + tok_in_blk * s_hot_tok  # [N] int64
        ptrs = hot_ptr + rows[:, None] + offs_d[None, :]  # [N, D]
        k = tl.load(ptrs, mask=hot_ok[:, None], other=0.0)
        v = tl.load(ptrs + s_hot_kv, mask=hot_ok[:, None], other=0.0)
    if HAS_WARM:
        rows = tok_slot * s_warm_slot + head * s_warm_head + tok_in_blk * s_warm_tok  # [N] int64
        if WARM_FORMAT == 2:  # int4: V = code * scale + zero per (token, group of V_GROUP channels)
            groups: tl.constexpr = HEAD_DIM // V_GROUP
            codes = tl.load(warm_ptr + s_warm_kv + rows[:, None] + tl.arange(0, HEAD_DIM // 8)[None, :],
                            mask=warm_ok[:, None], other=0)
            vs_ptrs = v_scale_ptr + (tok_slot * s_vs_slot + head * s_vs_head + tok_in_blk * groups)[:, None] + \
                tl.arange(0, groups)[None, :]  # [N, G]: each scale read once and broadcast over its channels
            v_scale = tl.load(vs_ptrs, mask=warm_ok[:, None], other=0.0)
            v_zero = tl.load(vs_ptrs + s_vs_slot // 2, mask=warm_ok[:, None], other=0.0)
            v8 = tl.reshape(nibble_words_to_fp16(codes, USE_ASM), [n, groups, V_GROUP])
            v8 = tl.reshape(v8 * v_scale[:, :, None] + v_zero[:, :, None], [n, HEAD_DIM])
        else:
            offs_w = tl.arange(0, HEAD_DIM // 4)
            v8 = tl.load(warm_ptr + s_warm_kv + rows[:, None] + offs_w[None, :], mask=warm_ok[:, None], other=0)
            if WARM_FORMAT == 1:  # fp8
                v8 = tl.reshape(fp8_words_to_fp16(v8, USE_ASM), [n, HEAD_DIM])
            else:
                v8 = tl.reshape(words_to_fp16(v8, USE_ASM), [n, HEAD_DIM])
            vs_ptrs = v_scale_ptr + tok_slot * s_vs_slot + head * s_vs_head + tok_in_blk
            v_mul = tl.where(warm_ok, tl.load(vs_ptrs, mask=warm_ok, other=0.0), tok_ok.to(tl.float32)) * V_BOOST
        k8 = load_warm_k(
            warm_ptr, k_scale_ptr, slot_row, pos_row, is_int8_row, s_ent, s_i8_blk, j0, idx_hi, n_tok, head,
            s_warm_slot, s_warm_head, s_warm_tok, s_ks_slot, s_ks_head,
            HEAD_DIM, BLOCK_TOKENS, BLOCKS_PER_ITER, HAS_HOT, PARTITIONED, USE_ASM, WARM_FORMAT, K_GROUP,
        )
        if HAS_HOT:
            k += k8  # each element comes from one pool; the other load gave 0
            v += v8
        else:
            k = k8
            v = v8
    return k, v, v_mul
