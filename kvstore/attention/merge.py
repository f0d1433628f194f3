"""The merge step of flash-decoding for kvstore.attention.paged_decode: splits -> output and block mass, one launch.

The split kernels (split_walk.py, one_tile.py) leave, per (row, q head, split), the split's normalized
output and its log2-sum-exp2, and per (row, q head, block) the block's log2-sum-exp2. `_merge_kernel`
runs a program per (row, kv head, p): each finds its group's log-sum-exp over the splits (a few hundred
floats), program p < GROUP also weights q head p's splits by exp2(lse_split - lse) into the output, and
program p turns chunk p of the block log-sums into softmax mass averaged over the group's q heads (what
H2O adds up). One launch, not a combine kernel and a mass kernel that wait on each other. With a score table
(batch 1, the decode step's H2O scores) the mass is added into it where the block table's entries came
from, instead of into a buffer a scatter would read: one launch less per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstore.attention.plan import DecodeGeometry

# Splits per step of the merge: a partitioned 1M row's 66 (33 a pool, llama3-8b) in one step, 6.3 us on the H200
# against 9.0 in two 64-wide steps: bench_longctx.int8_bench; BENCHMARKS.md, Paged decode kernel
_MAX_SPLIT_CHUNK = 128
_MASS_CHUNK = 256  # blocks per program of the mass


@triton.jit
def store_split(o_part_ptr, lse_part_ptr, part, m_i, l_i, acc, g_ok, HEAD_DIM: tl.constexpr):
    """A split kernel's result for rows `part` [M] of o_part / lse_part: acc [M, D] / l, and log2-sum-exp2
    m + log2(l) (-inf where l = 0: a split or tile with no tokens)."""
    offs_d = tl.arange(0, HEAD_DIM)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    tl.store(o_part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None], mask=g_ok[:, None])
    tl.store(lse_part_ptr + part, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=g_ok)


@triton.jit
def _merge_kernel(
    o_part_ptr, lse_part_ptr, lse_block_ptr, num_tokens_ptr, out_ptr, mass_ptr, scores_ptr, index_ptr, lse_out_ptr,
    s_out_batch, s_out_head, num_kv_heads, num_splits, max_blocks, s_sc_head, s_ix_head, s_ix_blk,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr, MASS_CHUNK: tl.constexpr, RETURN_MASS: tl.constexpr, STORE_MASS: tl.constexpr,
    ADD_MASS: tl.constexpr, STORE_LSE: tl.constexpr,
):
    """Program (b, kv head, p): out of q head p of the group (p < GROUP); the mass of chunk p of the row's blocks
    (RETURN_MASS): stored in mass[b, head] (STORE_MASS) and/or added to scores[head, index[head, j]] (ADD_MASS,
    batch 1; a head's index entries are distinct, so no two programs touch one score); with STORE_LSE, q head p's
    log-sum-exp of the scaled logits (natural log; -inf without tokens) in lse_out[b, head * GROUP + p].

    One pass over the splits, online: the group's running max m and sum of exp2 [G], and q head p's
    weighted output. Every load of a step is issued at once (the block log-sums before the pass), so a
    short table's merge waits on memory once.
    """
    b = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.program_id(2)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_s = tl.arange(0, SPLIT_CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_j = p * MASS_CHUNK + tl.arange(0, MASS_CHUNK)
    g_ok = offs_g < GROUP
    is_out = p < GROUP  # this program writes q head p's output
    out_splits = tl.where(is_out, num_splits, 0)  # the splits of q head p it reads
    rows = (b * num_kv_heads + head) * GROUP + offs_g  # [G] q-head rows
    row_p = (b * num_kv_heads + head) * GROUP + p
    if RETURN_MASS:  # past the row's blocks lse_block is unwritten: masked below, not at the load
        lse_block = tl.load(lse_block_ptr + rows[:, None] * max_blocks + offs_j[None, :],
                            mask=g_ok[:, None] & (offs_j < max_blocks)[None, :], other=0.0)  # [G, C]
        n_blocks = tl.cdiv(tl.load(num_tokens_ptr + b), BLOCK_TOKENS)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s0 in range(0, num_splits, SPLIT_CHUNK):
        s_ok = s0 + offs_s < num_splits
        lse = tl.load(lse_part_ptr + rows[:, None] * num_splits + s0 + offs_s[None, :],
                      mask=g_ok[:, None] & s_ok[None, :], other=float("-inf"))  # [G, S]
        o_ok = s0 + offs_s < out_splits
        lse_p = tl.load(lse_part_ptr + row_p * num_splits + s0 + offs_s, mask=o_ok, other=float("-inf"))
        o = tl.load(o_part_ptr + (row_p * num_splits + s0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=o_ok[:, None], other=0.0)  # [S, D]
        m_new = tl.maximum(m, tl.max(lse, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split with tokens yet: every weight 0
        alpha = tl.exp2(m - m_ref)  # [G]
        total = total * alpha + tl.sum(tl.exp2(lse - m_ref[:, None]), 1)
        m_ref_p = tl.sum(tl.where(offs_g == p, m_ref, 0.0), 0)
        alpha_p = tl.sum(tl.where(offs_g == p, alpha, 0.0), 0)
        acc = acc * alpha_p + tl.sum(tl.exp2(lse_p - m_ref_p)[:, None] * o, 0)
        m = m_new
    if is_out:
        total_p = tl.sum(tl.where(offs_g == p, total, 0.0), 0)
        out = acc / tl.where(total_p > 0, total_p, 1.0)
        tl.store(out_ptr + b * s_out_batch + (head * GROUP + p) * s_out_head + offs_d, out.to(tl.float16))
        if STORE_LSE:  # base 2 of log2(e)-scaled scores -> natural log of the scaled logits
            m_p = tl.sum(tl.where(offs_g == p, m, 0.0), 0)
            lse2 = tl.where(total_p > 0, m_p + tl.log2(tl.where(total_p > 0, total_p, 1.0)), float("-inf"))
            tl.store(lse_out_ptr + row_p, lse2 * 0.6931471805599453)
    if RETURN_MASS:
        m = tl.where(m == float("-inf"), 0.0, m)
        lse = tl.where(total > 0, m + tl.log2(tl.where(total > 0, total, 1.0)), 0.0)  # [G]
        ok = g_ok[:, None] & (offs_j < n_blocks)[None, :]  # [G, C]
        mass = tl.sum(tl.exp2(tl.where(ok, lse_block - lse[:, None], float("-inf"))), 0) / GROUP
        if STORE_MASS:
            tl.store(mass_ptr + (b * num_kv_heads + head) * max_blocks + offs_j, mass, mask=offs_j < max_blocks)
        if ADD_MASS:
            live = (offs_j < n_blocks) & (offs_j < max_blocks)
            idx = tl.load(index_ptr + head * s_ix_head + offs_j * s_ix_blk, mask=live, other=0)
            score_ptrs = scores_ptr + head * s_sc_head + idx
            tl.store(score_ptrs, tl.load(score_ptrs, mask=live, other=0.0) + mass, mask=live)


def empty_partials(geom: DecodeGeometry, num_splits: int, return_block_mass: bool,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a split walk fills for merge_splits: o_part, lse_part and lse_block (a stand-in [1] without mass)."""
    b, nq, f32 = geom.batch, geom.num_q_heads, torch.float32
    o_part = torch.empty((b, nq, num_splits, geom.head_dim), dtype=f32, device=device)  # [B, Hq, S, D]
    lse_part = torch.empty((b, nq, num_splits), dtype=f32, device=device)  # [B, Hq, S]
    lse_block = torch.empty((b, nq, geom.max_blocks) if return_block_mass else (1,), dtype=f32, device=device)
    return o_part, lse_part, lse_block


def merge_splits(
    o_part: torch.Tensor, lse_part: torch.Tensor, lse_block: torch.Tensor, num_tokens: torch.Tensor,
    geom: DecodeGeometry, return_block_mass: bool, add_mass_to: tuple[torch.Tensor, torch.Tensor] | None = None,
    lse_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """o_part f32 [B, Hq, S, D], lse_part f32 [B, Hq, S], lse_block f32 [B, Hq, max_blocks] (read only with
    return_block_mass or add_mass_to) -> (out fp16 [B, Hq, D], block mass f32 [B, H, max_blocks] or None).
    add_mass_to: (scores f32 [H, n], index int [H, max_blocks]), batch 1: scores[h, index[h, j]] += mass of
    block j of row h, for the row's live blocks (see paged_decode). lse_out f32 [B, Hq]: filled with each q
    head's log-sum-exp of the scaled logits (see paged_decode)."""
    b, nq, num_splits, d = o_part.shape
    h, max_blocks = geom.num_kv_heads, geom.max_blocks
    out = torch.empty((b, nq, d), dtype=torch.float16, device=o_part.device)  # [B, Hq, D]
    mass = torch.empty((b, h, max_blocks) if return_block_mass else (1,), dtype=torch.float32,
                       device=o_part.device)  # [B, H, max_blocks]
    with_mass = return_block_mass or add_mass_to is not None
    scores, index = add_mass_to if add_mass_to is not None else (mass, mass.view(1, -1))  # unread without ADD_MASS
    programs = max(geom.group, triton.cdiv(max_blocks, _MASS_CHUNK) if with_mass else 0)
    _merge_kernel[(b, h, programs)](
        o_part, lse_part, lse_block, num_tokens, out, mass, scores, index, lse_out if lse_out is not None else mass,
        out.stride(0), out.stride(1), h,
        num_splits, max_blocks, scores.stride(0), index.stride(0), index.stride(1),
        GROUP=geom.group, GROUP_PAD=triton.next_power_of_2(geom.group), HEAD_DIM=d, BLOCK_TOKENS=geom.block_tokens,
        SPLIT_CHUNK=min(_MAX_SPLIT_CHUNK, triton.next_power_of_2(num_splits)), MASS_CHUNK=_MASS_CHUNK,
        RETURN_MASS=with_mass, STORE_MASS=return_block_mass, ADD_MASS=add_mass_to is not None,
        STORE_LSE=lse_out is not None, num_warps=4,
    )
    return out, (mass if return_block_mass else None)
