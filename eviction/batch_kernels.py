"""Quest selection and H2O accounting over B sequences' block tables in one launch each.

The batched decode step (kvstore/decode/batch.py) serves B sequences whose tables are separate tensors of
different capacities. One launch per sequence and layer leaves each launch a few microseconds of latency
around very little work (~1.3 ms of a 12-sequence token per sequence on the H200: BENCHMARKS.md, Serving
many sequences); stacking the tables per token would copy every summary. Instead each program loads its
sequence's tensor address from an int64 array [B] built once per batch membership (a decode step reserves
its tables at a fixed capacity, so the addresses hold while the membership does), and one launch covers
every sequence:

    quest_scores_rows   [B, H, N] Quest upper bounds (quest_kernel.py), blocks past each sequence's device
                        count -inf, its sinks and recent window +inf
    topk_table_rows     each row's top k, ascending (topk_kernel.py's threshold selection), and the winners'
                        kernel block table read from that sequence's slot and tier maps
    add_mass_rows       the attention kernel's block mass [B, H, k] into each sequence's H2O scores

Each has a torch reference over the lists of tensors; the kernels are tested against them.
Layout: kernels -> launchers -> references. Imports only torch and triton (and the kernels it extends).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eviction.quest_kernel import LIVE_BLOCK_N, LIVE_WARPS, _quest_tile, quest_scores_live_ref
from eviction.select import top_blocks
from eviction.topk_kernel import CHUNK, _chunk_topk_kernel, _keys, _store_table, _warps, _winners, can_select, \
    two_stage


@triton.jit(do_not_specialize=["num_blocks", "sink_blocks", "recent", "block_tokens"])
def _quest_rows_kernel(q_ptr, s_addrs, like_s, out_ptr, count_ptr, num_blocks, sink_blocks, recent, block_tokens,
                       stride_qb, stride_qh, stride_sn, stride_sm, stride_sh, stride_ob, stride_oh,
                       GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """Program (block chunk, kv head, sequence): quest_kernel's tile over that sequence's summaries."""
    head = tl.program_id(1)
    row = tl.program_id(2)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    s_ptr = tl.load(s_addrs + row).to(like_s.dtype)
    score = _quest_tile(q_ptr + row * stride_qb, s_ptr, count_ptr + row, offs_n, head, num_blocks, sink_blocks,
                        recent, block_tokens, stride_qh, stride_sn, stride_sm, stride_sh, GROUP, GROUP_PAD,
                        HEAD_DIM, BLOCK_D, BLOCK_N, True, True, True)
    tl.store(out_ptr + row * stride_ob + head * stride_oh + offs_n, score, mask=offs_n < num_blocks)


@triton.jit
def _rows_table_kernel(src_ptr, idx_ptr, s_src, n, k, heads, out_ptr, s_out, slot_addrs, tier_addrs, like_slot,
                       like_tier, slots_ptr, is_int8_ptr, s_table, int8_tier, BLOCK: tl.constexpr,
                       FROM_SCORES: tl.constexpr):
    """One program per row (sequence row // heads): the row's k winners ascending and their block table.
    FROM_SCORES: src holds the float scores; else stage one's int32 candidate keys, their indices in idx."""
    row = tl.program_id(0)
    seq = row // heads
    offs = tl.arange(0, BLOCK)
    valid = offs < n
    if FROM_SCORES:
        x = tl.load(src_ptr + row * s_src + offs, mask=valid, other=float("-inf")).to(tl.float32)
        take = _winners(_keys(x, valid), k) & valid
        idx = offs
    else:
        key = tl.load(src_ptr + row * s_src + offs, mask=valid, other=-2147483647 - 1)
        take = _winners(key, k) & valid
        idx = tl.load(idx_ptr + row * s_src + offs, mask=take, other=0)
    pos = tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + row * s_out + pos, idx.to(tl.int64), mask=take)
    slot_map = tl.load(slot_addrs + seq).to(like_slot.dtype)
    tier_map = tl.load(tier_addrs + seq).to(like_tier.dtype)
    _store_table(idx, take, pos, row, slot_map, tier_map, slots_ptr, is_int8_ptr, s_table, int8_tier)


@triton.jit
def _add_mass_kernel(mass_ptr, s_mass, sel_ptr, s_sel, k, heads, h2o_addrs, like_h2o, h2o_strides,
                     BLOCK_K: tl.constexpr):
    """One program per row: h2o[head, selected[j]] += mass[j]. A row's selection holds distinct blocks and
    rows of one sequence are distinct heads, so no two programs touch one score."""
    row = tl.program_id(0)
    seq = row // heads
    head = row % heads
    offs = tl.arange(0, BLOCK_K)
    valid = offs < k
    h2o = tl.load(h2o_addrs + seq).to(like_h2o.dtype) + head * tl.load(h2o_strides + seq)
    sel = tl.load(sel_ptr + row * s_sel + offs, mask=valid, other=0)
    mass = tl.load(mass_ptr + row * s_mass + offs, mask=valid, other=0.0)
    tl.store(h2o + sel, tl.load(h2o + sel, mask=valid, other=0.0) + mass, mask=valid)


def addresses(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """int64 [B]: each tensor's address, for the kernels here (the tensors must not move while it is used)."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)


def quest_scores_rows(q: torch.Tensor, summaries: list[torch.Tensor], s_addrs: torch.Tensor, counts: torch.Tensor,
                      num_blocks: int, *, block_tokens: int, sink_blocks: int, recent_tokens: int,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [B, H, num_blocks]: row b is quest_scores_live(q[b], summaries[b], counts[b:b+1]) padded with
    -inf past summaries[b]'s capacity. q fp16 [B, Hq, D]; summaries: B tensors [capacity_b, 2, H, D] of one
    dtype and layout (s_addrs = addresses(summaries)); counts int64 [B]; num_blocks >= every capacity."""
    b, hq, d = q.shape
    first = summaries[0]
    if len(summaries) != b or s_addrs.shape != (b,) or counts.shape != (b,) or counts.dtype != torch.int64:
        raise ValueError(f"quest_scores_rows: {b} rows of q need {b} summaries, addresses and int64 counts, got "
                         f"{len(summaries)}, {list(s_addrs.shape)}, {counts.dtype} {list(counts.shape)}")
    if any(s.shape[1:] != first.shape[1:] or s.stride()[1:] != first.stride()[1:] or s.dtype != first.dtype
           or s.shape[0] > num_blocks for s in summaries) or q.stride(2) != 1 or first.stride(3) != 1:
        raise ValueError(f"quest_scores_rows: summaries of one dtype and layout [<= {num_blocks}, 2, H, {d}] "
                         f"with a contiguous last dim expected")
    heads = first.shape[2]
    if out is None:
        out = torch.empty((b, heads, num_blocks), dtype=torch.float32, device=q.device)  # [B, H, N]
    group = hq // heads
    grid = (triton.cdiv(num_blocks, LIVE_BLOCK_N), heads, b)
    _quest_rows_kernel[grid](q, s_addrs, first, out, counts, num_blocks, sink_blocks, recent_tokens, block_tokens,
                             q.stride(0), q.stride(1), first.stride(0), first.stride(1), first.stride(2),
                             out.stride(0), out.stride(1), GROUP=group,
                             GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=d,
                             BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_N=LIVE_BLOCK_N, num_warps=LIVE_WARPS)
    return out


def quest_scores_rows_ref(q: torch.Tensor, summaries: list[torch.Tensor], counts: torch.Tensor, num_blocks: int, *,
                          block_tokens: int, sink_blocks: int, recent_tokens: int) -> torch.Tensor:
    """`quest_scores_rows` in torch, one sequence at a time."""
    out = torch.full((q.shape[0], summaries[0].shape[2], num_blocks), float("-inf"), device=q.device)
    for i, s in enumerate(summaries):
        out[i, :, : s.shape[0]] = quest_scores_live_ref(q[i], s, counts[i: i + 1], block_tokens=block_tokens,
                                                        sink_blocks=sink_blocks, recent_tokens=recent_tokens)
    return out


def topk_table_rows(scores: torch.Tensor, k: int, slot_addrs: torch.Tensor, tier_addrs: torch.Tensor,
                    like: tuple[torch.Tensor, torch.Tensor], int8_tier: int) -> tuple[torch.Tensor, ...]:
    """scores float32 [B, H, n] -> (selected int64 [B, H, k] ascending, slots int32 [B, H, k] = sequence b's
    slot_map[selected], is_int8 bool [B, H, k] = its tier_map[selected] == int8_tier). slot_addrs, tier_addrs:
    addresses of each sequence's int32 slot_map and int8 tier_map (like: one of each, for their dtypes)."""
    b, heads, n = scores.shape
    if not 0 < k <= n or not can_select(n, k) or scores.stride(2) != 1:
        raise ValueError(f"topk_table_rows: rows of {n} contiguous scores with k in [1, {n}] that fit in "
                         f"registers expected, got k {k}")
    if like[0].dtype != torch.int32 or like[1].dtype != torch.int8:
        raise ValueError(f"slot maps int32 and tier maps int8 expected, got {like[0].dtype}, {like[1].dtype}")
    rows = scores.view(b * heads, n)
    out = torch.empty((b, heads, k), dtype=torch.int64, device=scores.device)
    slots = torch.empty((b, heads, k), dtype=torch.int32, device=scores.device)
    is_int8 = torch.empty((b, heads, k), dtype=torch.bool, device=scores.device)
    src, idx, width, from_scores = rows, rows, n, True
    if two_stage(n, k):  # every CHUNK scores keep their own top k (topk_kernel.py), then one program per row
        chunks = triton.cdiv(n, CHUNK)
        src = torch.empty((b * heads, chunks * k), dtype=torch.int32, device=scores.device)
        idx = torch.empty_like(src)
        _chunk_topk_kernel[(chunks, b * heads)](rows, rows.stride(0), n, k, src, idx, src.stride(0), CHUNK=CHUNK,
                                                num_warps=4)
        width, from_scores = chunks * k, False
    block = max(triton.next_power_of_2(width), 128)
    _rows_table_kernel[(b * heads,)](src, idx, src.stride(0), width, k, heads, out, k, slot_addrs, tier_addrs,
                                     like[0], like[1], slots, is_int8, k, int8_tier, BLOCK=block,
                                     FROM_SCORES=from_scores, num_warps=_warps(block))
    return out, slots, is_int8


def topk_table_rows_ref(scores: torch.Tensor, k: int, slot_maps: list[torch.Tensor], tier_maps: list[torch.Tensor],
                        int8_tier: int) -> tuple[torch.Tensor, ...]:
    """`topk_table_rows` in torch, one sequence at a time."""
    selected = torch.stack([top_blocks(row, k) for row in scores])  # [B, H, k]
    slots = torch.stack([m[s] for m, s in zip(slot_maps, selected)])
    is_int8 = torch.stack([m[s] == int8_tier for m, s in zip(tier_maps, selected)])
    return selected, slots, is_int8


def add_mass_rows(mass: torch.Tensor, selected: torch.Tensor, h2o_addrs: torch.Tensor, like_h2o: torch.Tensor,
                  h2o_strides: torch.Tensor) -> None:
    """Sequence b's H2O scores (fp32 [H, capacity_b], row stride h2o_strides[b]) [h, selected[b, h]] +=
    mass[b, h] for every b and h. mass float32 [B, H, >= k] (the kernel's, its first k entries), selected
    int64 [B, H, k] with distinct blocks per row."""
    b, heads, k = selected.shape
    if mass.shape[:2] != (b, heads) or mass.shape[2] < k or mass.dtype != torch.float32 or \
            like_h2o.dtype != torch.float32 or mass.stride(2) != 1 or mass.stride(0) != heads * mass.stride(1) or \
            not selected.is_contiguous():
        raise ValueError(f"add_mass_rows: mass float32 [{b}, {heads}, >= {k}] and a contiguous selection expected, "
                         f"got {mass.dtype} {list(mass.shape)}")
    _add_mass_kernel[(b * heads,)](mass, mass.stride(1), selected, k, k, heads, h2o_addrs, like_h2o, h2o_strides,
                                   BLOCK_K=max(16, triton.next_power_of_2(k)), num_warps=1)


def add_mass_rows_ref(mass: torch.Tensor, selected: torch.Tensor, h2o_scores: list[torch.Tensor]) -> None:
    """`add_mass_rows` in torch, one sequence at a time."""
    for scores, sel, m in zip(h2o_scores, selected, mass):
        scores.scatter_add_(1, sel, m[:, : sel.shape[1]])
