"""Paged decode over a short table (a top-k budget): every program attends one tile of its row, one launch.

Grid (batch, kv heads, tiles): program t reads entries [t * BLOCKS_PER_ITER, ...) of its row of the block
table. A short table is latency bound, not bandwidth bound (64 entries of 64 tokens per kv head: ~14 MB,
~3 us of HBM), so each program waits on memory only twice: once for its entries, pool flags, token count
and q together (no load waits on the token count), once for its K/V. The loops of the split walk
(split_walk.py) wait twice per iteration and their table partition (partition.py) is a launch of its
own. Each tile is read in the format its flags name, whatever the mix: all fp16, all int8, or, for a
tile astride the two, both under masks. merge.py merges the tiles as it merges splits.

Math as in split_walk._attend, over one tile: base-2 scores, p * v_scale * V_BOOST for int8 V.
Config (tile size, warps): plan.decode_config. Reference: reference.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstore.attention.append import NewToken, append_head
from kvstore.attention.merge import empty_partials, store_split
from kvstore.attention.plan import DecodeConfig, DecodeGeometry, scale_strides
from kvstore.attention.tiles import load_kv_at


@triton.jit
def _one_tile_kernel(
    q_ptr, hot_ptr, warm_ptr, k_scale_ptr, v_scale_ptr, table_ptr, is_int8_ptr, num_tokens_ptr,
    o_part_ptr, lse_part_ptr, lse_block_ptr,
    new_k_ptr, new_v_ptr, sum_ptr, tail_slot_ptr, count_ptr,  # APPEND (append.py NewToken), else unused
    s_q_batch, s_q_head, s_new_head, s_sum_blk, s_sum_kind, s_sum_head,
    s_hot_slot, s_hot_kv, s_hot_head, s_hot_tok,
    s_warm_slot, s_warm_kv, s_warm_head, s_warm_tok,
    s_ks_slot, s_ks_head, s_vs_slot, s_vs_head,
    s_tab_batch, s_tab_head, s_tab_blk, s_i8_batch, s_i8_head, s_i8_blk,
    qk_scale, max_blocks, num_q_heads,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
    BLOCKS_PER_ITER: tl.constexpr, HAS_HOT: tl.constexpr, HAS_WARM: tl.constexpr, RETURN_MASS: tl.constexpr,
    USE_ASM: tl.constexpr, APPEND: tl.constexpr, WARM_FORMAT: tl.constexpr, K_GROUP: tl.constexpr,
    V_GROUP: tl.constexpr,
):
    """Program (b, kv head, tile): the group's q heads over one tile; normalized output and log2-sum-exp2 as
    split `tile` of o_part / lse_part, and (RETURN_MASS) each block's log2-sum-exp2 in lse_block.
    APPEND (batch 1): the row's last token is the new one (k, v at new_k / new_v): the program whose tile holds
    it writes it to its hot tail slot and widens the block's summary (append.py) before it loads the tile."""
    V_BOOST: tl.constexpr = 256.0  # as in split_walk._attend
    N: tl.constexpr = BLOCKS_PER_ITER * BLOCK_TOKENS
    b = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    num_tiles = tl.num_programs(2)
    j0 = tile * BLOCKS_PER_ITER
    offs_n = tl.arange(0, N)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    blk = j0 + tl.arange(0, BLOCKS_PER_ITER)  # [J]
    tok_blk = j0 + offs_n // BLOCK_TOKENS  # [N]
    g_ok = offs_g < GROUP
    q_head = head * GROUP + offs_g  # [M]
    slot_row = table_ptr + b * s_tab_batch + head * s_tab_head
    is_int8_row = is_int8_ptr + b * s_i8_batch + head * s_i8_head

    # one round trip: the row's length, the tile's entries and flags (bounded by the table, not the
    # length, so none waits on it) and q
    n_tok = tl.load(num_tokens_ptr + b)
    tok_slot = tl.load(slot_row + tok_blk * s_tab_blk, mask=tok_blk < max_blocks, other=0).to(tl.int64)
    tok_int8 = tl.load(is_int8_row + tok_blk * s_i8_blk, mask=tok_blk < max_blocks, other=0) != 0
    blk_int8 = tl.load(is_int8_row + blk * s_i8_blk, mask=blk < max_blocks, other=0) != 0
    q = tl.load(q_ptr + b * s_q_batch + q_head[:, None] * s_q_head + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    if APPEND:
        new_k = tl.load(new_k_ptr + head * s_new_head + offs_d)
        new_v = tl.load(new_v_ptr + head * s_new_head + offs_d)

    n_blocks = tl.minimum(tl.cdiv(n_tok, BLOCK_TOKENS), max_blocks)
    tok_ok = (tok_blk < n_blocks) & (tok_blk * BLOCK_TOKENS + offs_n % BLOCK_TOKENS < n_tok)  # [N]
    blk_ok = blk < n_blocks  # [J]
    args = (
        hot_ptr, warm_ptr, k_scale_ptr, v_scale_ptr, slot_row, slot_row, is_int8_row, s_tab_blk, s_i8_blk,
        j0, n_blocks, n_tok, head, tok_slot, tok_ok, tok_int8,
        s_hot_slot, s_hot_kv, s_hot_head, s_hot_tok,
        s_warm_slot, s_warm_kv, s_warm_head, s_warm_tok,
        s_ks_slot, s_ks_head, s_vs_slot, s_vs_head,
    )
    if APPEND:  # the program whose tile holds the new token (the row's last) stores it before its tile's loads,
        # a barrier ordering them for all its threads: it reads the bits append-then-attend reads, and every other
        # program's tile pipeline is unchanged (selecting the row into every tile instead costs ~8%: BENCHMARKS.md,
        # Paged decode kernel)
        row = n_tok - 1 - j0 * BLOCK_TOKENS
        if (row >= 0) & (row < N):
            append_head(hot_ptr, sum_ptr, tail_slot_ptr, count_ptr, new_k, new_v, head, offs_d, s_hot_slot,
                        s_hot_kv, s_hot_head, s_hot_tok, s_sum_blk, s_sum_kind, s_sum_head, BLOCK_TOKENS)
            tl.debug_barrier()
    # constexprs spelled out at each call: a tuple of them compiles to tensors (the interpreter does not mind)
    if HAS_HOT and HAS_WARM:
        n_int8 = tl.sum((blk_ok & blk_int8).to(tl.int32), 0)
        if n_int8 == 0:
            k, v, v_mul = load_kv_at(*args, HEAD_DIM, BLOCK_TOKENS, BLOCKS_PER_ITER, True, False, False, USE_ASM,
                                     V_BOOST, WARM_FORMAT, K_GROUP, V_GROUP)
        elif n_int8 == tl.sum(blk_ok.to(tl.int32), 0):
            k, v, v_mul = load_kv_at(*args, HEAD_DIM, BLOCK_TOKENS, BLOCKS_PER_ITER, False, True, False, USE_ASM,
                                     V_BOOST, WARM_FORMAT, K_GROUP, V_GROUP)
        else:
            k, v, v_mul = load_kv_at(*args, HEAD_DIM, BLOCK_TOKENS, BLOCKS_PER_ITER, True, True, False, USE_ASM,
                                     V_BOOST, WARM_FORMAT, K_GROUP, V_GROUP)
    else:
        k, v, v_mul = load_kv_at(*args, HEAD_DIM, BLOCK_TOKENS, BLOCKS_PER_ITER, HAS_HOT, HAS_WARM, False, USE_ASM,
                                 V_BOOST, WARM_FORMAT, K_GROUP, V_GROUP)

    s = tl.dot(q, tl.trans(k)) * qk_scale  # [M, N], log2 domain
    s = tl.where(tok_ok[None, :], s, float("-inf"))
    m = tl.max(s, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # a tile past the row's end: p = 0 everywhere
    p = tl.exp2(s - m[:, None])  # [M, N]
    l_i = tl.sum(p, 1)
    if HAS_WARM:
        acc = tl.dot((p * v_mul[None, :]).to(tl.float16), v) / V_BOOST  # fp16 tiles: v_mul = V_BOOST
    else:
        acc = tl.dot(p.to(tl.float16), v)
    if RETURN_MASS:
        block_sum = tl.sum(tl.reshape(p, [GROUP_PAD, BLOCKS_PER_ITER, BLOCK_TOKENS]), 2)  # [M, J]
        block_lse = tl.where(block_sum > 0, m[:, None] + tl.log2(tl.where(block_sum > 0, block_sum, 1.0)),
                             float("-inf"))
        lse_rows = lse_block_ptr + (b * num_q_heads + q_head) * max_blocks  # [M] pointers
        tl.store(lse_rows[:, None] + blk[None, :], block_lse, mask=g_ok[:, None] & blk_ok[None, :])
    part = (b * num_q_heads + q_head) * num_tiles + tile  # [M]
    store_split(o_part_ptr, lse_part_ptr, part, m, l_i, acc, g_ok, HEAD_DIM)


def one_tile_partials(
    q: torch.Tensor, hot_pool: torch.Tensor, warm_words: torch.Tensor, warm_k_scale: torch.Tensor,
    warm_v_scale: torch.Tensor, block_table: torch.Tensor, block_is_int8: torch.Tensor, num_tokens: torch.Tensor,
    geom: DecodeGeometry, cfg: DecodeConfig, qk_scale: float, return_block_mass: bool, use_asm: bool,
    append: NewToken | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Arguments as paged_decode checked them (warm_words: warm_data viewed as int32, flags as int8; append:
    a checked NewToken, batch 1, whose token is each row's last) ->
    o_part f32 [B, Hq, S, D], lse_part f32 [B, Hq, S], lse_block f32 [B, Hq, max_blocks] (or [1] without mass)
    with one split per tile: S = cfg.num_splits = ceil(max_blocks / cfg.blocks_per_iter)."""
    o_part, lse_part, lse_block = empty_partials(geom, cfg.num_splits, return_block_mass, q.device)
    _one_tile_kernel[(geom.batch, geom.num_kv_heads, cfg.num_splits)](
        q, hot_pool, warm_words, warm_k_scale, warm_v_scale, block_table, block_is_int8, num_tokens,
        o_part, lse_part, lse_block,
        *(append or (q,) * 5),  # unused pointers without APPEND
        q.stride(0), q.stride(1), *((append.k.stride(0), *append.summaries.stride()[:3]) if append else (0,) * 4),
        hot_pool.stride(0), hot_pool.stride(1), hot_pool.stride(2), hot_pool.stride(3),
        warm_words.stride(0), warm_words.stride(1), warm_words.stride(2), warm_words.stride(3),
        *scale_strides(warm_k_scale), *scale_strides(warm_v_scale),
        *block_table.stride(), *block_is_int8.stride(),
        qk_scale, geom.max_blocks, geom.num_q_heads,
        GROUP=geom.group, GROUP_PAD=max(16, triton.next_power_of_2(geom.group)), HEAD_DIM=geom.head_dim,
        BLOCK_TOKENS=geom.block_tokens, BLOCKS_PER_ITER=cfg.blocks_per_iter,
        HAS_HOT=hot_pool.shape[0] > 0, HAS_WARM=warm_words.shape[0] > 0, RETURN_MASS=return_block_mass,
        USE_ASM=use_asm, APPEND=append is not None, WARM_FORMAT=geom.warm_format, K_GROUP=max(1, geom.k_group),
        V_GROUP=max(1, geom.v_group), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return o_part, lse_part, lse_block
