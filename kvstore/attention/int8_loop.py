"""The split walk's loop over int8 (warm) entries with the scales folded out of the tile: no dequantize.

KIVI's scales are per (block, channel) for K and per token for V, so neither needs to touch the int8
tile: q . (code_k * k_scale) = (q * k_scale) . code_k, one [group, D] product per block, and
p . (code_v * v_scale) = (p * v_scale) . code_v, one [group, T] product. What is left per element is
the int8 -> fp16 conversion, written as a plain cast so the compiler can move it past the shared-memory
round trip into the dot's operand layout (the int8 tile crosses shared memory at half the bytes).
The tile loop in tiles.py dequantizes [T, D] in registers and multiplies every K element by its scale.

One block per iteration (k_scale differs per block). Same outputs as paged_decode._split_kernel's warm
launches: partial output and log2-sum-exp2 per split, and per block its log2-sum-exp2 (merge.py reads
them). Direct (one pool: the table is the row) or PARTITIONED (partition.py's int8 entries, splits
[pool_splits, 2 pool_splits)). Reference: reference.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstore.attention.plan import DecodeConfig, DecodeGeometry


@triton.jit
def _load_block(slot_row, pos_row, s_tab_blk, j, hi, n_tok, head, warm_ptr, k_scale_ptr, v_scale_ptr, tile,
                offs_d, offs_t, s_warm_slot, s_warm_kv, s_warm_head, s_ks_slot, s_ks_head, s_vs_slot, s_vs_head,
                BLOCK_TOKENS: tl.constexpr, PARTITIONED: tl.constexpr):
    """Entry j of the row: int8 K and V [T, D], K's scales [D], V's scales [T], its position in the table and
    which of its tokens are live. Past the range (j >= hi) nothing is read: zeros, no live token."""
    jc = tl.maximum(tl.minimum(j, hi - 1), 0)  # an entry of the table, whatever j is
    slot = tl.load(slot_row + jc * s_tab_blk).to(tl.int64)
    pos = tl.load(pos_row + jc * s_tab_blk) if PARTITIONED else jc
    ok_t = (offs_t * 0 + j) < hi  # [T]
    base = warm_ptr + slot * s_warm_slot + head * s_warm_head
    k8 = tl.load(base + tile, mask=ok_t[:, None], other=0)
    v8 = tl.load(base + s_warm_kv + tile, mask=ok_t[:, None], other=0)
    k_scale = tl.load(k_scale_ptr + slot * s_ks_slot + head * s_ks_head + offs_d, mask=(offs_d * 0 + j) < hi,
                      other=0.0)
    tok_ok = (pos * BLOCK_TOKENS + offs_t < n_tok) & ok_t
    v_scale = tl.load(v_scale_ptr + slot * s_vs_slot + head * s_vs_head + offs_t, mask=tok_ok, other=0.0)
    return k8, v8, k_scale, v_scale, pos, tok_ok


@triton.jit
def _int8_split_kernel(
    q_ptr, warm_ptr, k_scale_ptr, v_scale_ptr, table_ptr, pos_ptr, num_tokens_ptr, num_fp16_ptr,
    o_part_ptr, lse_part_ptr, lse_block_ptr,
    s_q_batch, s_q_head, s_warm_slot, s_warm_kv, s_warm_head, s_warm_tok,
    s_ks_slot, s_ks_head, s_vs_slot, s_vs_head,
    s_tab_batch, s_tab_head, s_tab_blk, s_nf_batch, s_nf_head,
    qk_scale, blocks_per_split, pool_splits, split_base, num_splits, max_blocks, num_q_heads,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
    PARTITIONED: tl.constexpr, RETURN_MASS: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Program (b, kv head, split): the group's q heads over one range of int8 entries, online softmax.
    PREFETCH: entry j + 1's loads are issued before entry j's math (registers double-buffered)."""
    V_BOOST: tl.constexpr = 256.0  # p * v_scale * 256: out of fp16's subnormals (as in paged_decode._attend)
    b = tl.program_id(0)
    head = tl.program_id(1)
    split = split_base + tl.program_id(2)
    n_tok = tl.load(num_tokens_ptr + b)
    n_blocks = tl.minimum(tl.cdiv(n_tok, BLOCK_TOKENS), max_blocks)
    if PARTITIONED:  # this launch's splits share the row's int8 entries [num_fp16, n_blocks)
        pool_lo = tl.load(num_fp16_ptr + b * s_nf_batch + head * s_nf_head)
        per_split = tl.cdiv(n_blocks - pool_lo, pool_splits)
        lo = pool_lo + (split - pool_splits) * per_split
        hi = tl.minimum(lo + per_split, n_blocks)
    else:
        lo = split * blocks_per_split
        hi = tl.minimum(lo + blocks_per_split, n_blocks)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, BLOCK_TOKENS)
    g_ok = offs_g < GROUP
    q_head = head * GROUP + offs_g  # [M]
    q = tl.load(q_ptr + b * s_q_batch + q_head[:, None] * s_q_head + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    q = q.to(tl.float32) * qk_scale  # [M, D], log2 domain
    lse_rows = lse_block_ptr + (b * num_q_heads + q_head) * max_blocks  # [M] pointers
    slot_row = table_ptr + b * s_tab_batch + head * s_tab_head
    pos_row = pos_ptr + b * s_tab_batch + head * s_tab_head
    tile = offs_t[:, None] * s_warm_tok + offs_d[None, :]  # [T, D] offsets within a (slot, kv, head)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    load_args = (n_tok, head, warm_ptr, k_scale_ptr, v_scale_ptr, tile, offs_d, offs_t, s_warm_slot, s_warm_kv,
                 s_warm_head, s_ks_slot, s_ks_head, s_vs_slot, s_vs_head)
    if PREFETCH:
        nk8, nv8, nks, nvs, npos, nok = _load_block(slot_row, pos_row, s_tab_blk, lo, hi, *load_args,
                                                    BLOCK_TOKENS, PARTITIONED)
    for j in range(lo, hi):
        if PREFETCH:
            k8, v8, k_scale, v_scale, pos, tok_ok = nk8, nv8, nks, nvs, npos, nok
            nk8, nv8, nks, nvs, npos, nok = _load_block(slot_row, pos_row, s_tab_blk, j + 1, hi, *load_args,
                                                        BLOCK_TOKENS, PARTITIONED)
        else:
            k8, v8, k_scale, v_scale, pos, tok_ok = _load_block(slot_row, pos_row, s_tab_blk, j, hi, *load_args,
                                                                BLOCK_TOKENS, PARTITIONED)
        s = tl.dot((q * k_scale[None, :]).to(tl.float16), tl.trans(k8.to(tl.float16)))  # [M, T]
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = (p * (v_scale * V_BOOST)[None, :]).to(tl.float16)
        acc = tl.dot(pv, v8.to(tl.float16), acc * alpha[:, None])
        m_i = m_new
        if RETURN_MASS:
            block_sum = tl.sum(p, 1)  # [M]: > 0, the block has a live token
            tl.store(lse_rows + pos, m_new + tl.log2(block_sum), mask=g_ok)
    acc = acc / V_BOOST
    l_safe = tl.where(l_i > 0, l_i, 1.0)  # 0 only for a split with no entries
    part = (b * num_q_heads + q_head) * num_splits + split  # [M]
    tl.store(o_part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None], mask=g_ok[:, None])
    tl.store(lse_part_ptr + part, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=g_ok)


def launch_int8_loop(
    q: torch.Tensor, warm_data: torch.Tensor, warm_k_scale: torch.Tensor, warm_v_scale: torch.Tensor,
    table: torch.Tensor, positions: torch.Tensor, num_tokens: torch.Tensor, num_fp16: torch.Tensor,
    o_part: torch.Tensor, lse_part: torch.Tensor, lse_block: torch.Tensor,
    geom: DecodeGeometry, cfg: DecodeConfig, scale: float, split_base: int, grid_splits: int,
    partitioned: bool, return_block_mass: bool, prefetch: bool = False,
) -> None:
    """The int8 entries' launch of the split walk (paged_decode.split_partials' arguments; warm_data int8).
    Splits: cfg.num_splits per pool, cfg.blocks_per_split blocks each when direct."""
    total_splits = o_part.shape[2]
    _int8_split_kernel[(geom.batch, geom.num_kv_heads, grid_splits)](
        q, warm_data, warm_k_scale, warm_v_scale, table, positions, num_tokens, num_fp16,
        o_part, lse_part, lse_block,
        q.stride(0), q.stride(1), *warm_data.stride()[:4],
        warm_k_scale.stride(0), warm_k_scale.stride(1), warm_v_scale.stride(0), warm_v_scale.stride(1),
        *table.stride(), *num_fp16.stride(),
        scale, cfg.blocks_per_split, cfg.num_splits, split_base, total_splits, geom.max_blocks, geom.num_q_heads,
        GROUP=geom.group, GROUP_PAD=max(16, triton.next_power_of_2(geom.group)), HEAD_DIM=geom.head_dim,
        BLOCK_TOKENS=geom.block_tokens, PARTITIONED=partitioned, RETURN_MASS=return_block_mass, PREFETCH=prefetch,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
