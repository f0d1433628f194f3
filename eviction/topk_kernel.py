"""Per-row top-k indices, sorted ascending, by threshold selection in Triton (no host sync).

torch.topk + torch.sort over [kv_heads, num_blocks] costs ~80 us at 1M tokens whatever the
block count (several radix passes, each a launch), more than the Quest scan itself. Here a
program keeps a run of scores in registers, bisects on the order-preserving integer image of
the floats for the k-th largest value, and compacts the winners with a prefix sum: indices come
out already ascending, ties broken by the lower index (torch's stable sort order).

One program per row holding the whole row would use only kv_heads SMs (95 us per layer at
1M tokens, 17K blocks: BENCHMARKS.md, Top-K selection), so long rows go in two
stages: every CHUNK scores of a row keep their own top k (two-stage rows have k <= CHUNK / 4; the
global top k is always among them), then one program per row selects k of the
ceil(n / CHUNK) * k candidates, which sit in ascending index order, so the same compaction
gives ascending indices. Stage two can also write the kernel block table of the winners
(slot_map[i], tier_map[i] == int8_tier), which saves the decode step three gather launches.
Quest's scores and the top-k stay two launches (quest_scores_live, then topk_block_table): one fused
launch is slower on the H200 (BENCHMARKS.md, Top-K selection).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCKS = 65536  # scores one program holds in registers (stage two's candidates, or a short row)
FASTER_THAN_TORCH = 16384  # one-program rows measured on the H200 (select_bench); two stages go further
CHUNK = 1024  # scores per stage-one program


@triton.jit
def _keys(x, valid):
    """int32 images of float scores: a > b <=> key(a) > key(b); NaN as -inf; padding below everything."""
    x = tl.where(x != x, float("-inf"), x)
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(valid, key, -2147483647 - 1)


@triton.jit
def _kth_key(key, k):
    """The k-th largest key, its bits decided from the top on the unsigned image key ^ 0x80000000: 32
    counting passes with no 64-bit midpoint in their dependency chain: the fastest search for the decode
    step's top-k at 1M tokens on the H200, 16.0 us with the merge loading only the winners' indices
    (bench_longctx.select_bench; BENCHMARKS.md, Top-K selection)."""
    t = tl.full((), 0, tl.uint32)  # invariant: count(key >= t) >= k
    bit = tl.full((), 0x80000000, tl.uint32)
    for _ in range(32):
        cand = t | bit
        count = tl.sum((key >= (cand ^ 0x80000000).to(tl.int32, bitcast=True)).to(tl.int32), axis=0)
        t = tl.where(count >= k, cand, t)
        bit = bit >> 1
    return (t ^ 0x80000000).to(tl.int32, bitcast=True)


@triton.jit
def _winners(key, k):
    """bool mask of the k largest keys (ties: the first in order), for a block holding >= k entries."""
    t = _kth_key(key, k)
    above = key > t
    tied = key == t
    need = k - tl.sum(above.to(tl.int32), axis=0)
    return above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= need))


@triton.jit
def _store_table(idx, take, pos, row, slot_map_ptr, tier_map_ptr, slots_ptr, is_int8_ptr, s_table, int8_tier):
    """The winners' kernel block table: slots[row, pos] = slot_map[idx], is_int8[row, pos] = tier_map[idx] ==
    int8_tier, where `take`."""
    slot = tl.load(slot_map_ptr + idx, mask=take, other=0)
    tier = tl.load(tier_map_ptr + idx, mask=take, other=0)
    tl.store(slots_ptr + row * s_table + pos, slot, mask=take)
    tl.store(is_int8_ptr + row * s_table + pos, tier == int8_tier, mask=take)


@triton.jit
def _row_topk_kernel(scores_ptr, s_row, n, k, out_ptr, s_out, index_ptr, s_index,
                     slot_map_ptr, tier_map_ptr, slots_ptr, is_int8_ptr, s_table, int8_tier,
                     BLOCK: tl.constexpr, INDEX: tl.constexpr, TABLE: tl.constexpr):
    """One program per row: the row's k winners, ascending; with INDEX each winner's entry of its index row
    instead of its position, with TABLE also the winners' block table (_store_table)."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    valid = offs < n
    x = tl.load(scores_ptr + row * s_row + offs, mask=valid, other=float("-inf")).to(tl.float32)
    take = _winners(_keys(x, valid), k) & valid
    pos = tl.cumsum(take.to(tl.int32), axis=0) - 1
    idx = offs.to(tl.int64)
    if INDEX:
        idx = tl.load(index_ptr + row * s_index + offs, mask=take, other=0).to(tl.int64)
    tl.store(out_ptr + row * s_out + pos, idx, mask=take)
    if TABLE:
        _store_table(idx, take, pos, row, slot_map_ptr, tier_map_ptr, slots_ptr, is_int8_ptr, s_table, int8_tier)


@triton.jit
def _chunk_topk_kernel(scores_ptr, s_row, n, k, cand_key_ptr, cand_idx_ptr, s_cand, CHUNK: tl.constexpr):
    """Stage one, program (chunk, row): the chunk's k winners (padding past n included, keyed lowest)."""
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = offs < n
    x = tl.load(scores_ptr + row * s_row + offs, mask=valid, other=float("-inf")).to(tl.float32)
    key = _keys(x, valid)
    take = _winners(key, k)  # exactly k entries: the chunk always holds CHUNK >= k
    pos = chunk * k + tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(cand_key_ptr + row * s_cand + pos, key, mask=take)
    tl.store(cand_idx_ptr + row * s_cand + pos, offs, mask=take)


@triton.jit
def _merge_topk_kernel(cand_key_ptr, cand_idx_ptr, s_cand, num_cand, k, out_ptr, s_out,
                       slot_map_ptr, tier_map_ptr, slots_ptr, is_int8_ptr, s_table, int8_tier,
                       BLOCK: tl.constexpr, TABLE: tl.constexpr):
    """Stage two, one program per row: k winners of the candidates, ascending; with TABLE their block table."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    valid = offs < num_cand
    key = tl.load(cand_key_ptr + row * s_cand + offs, mask=valid, other=-2147483647 - 1)
    take = _winners(key, k) & valid
    idx = tl.load(cand_idx_ptr + row * s_cand + offs, mask=take, other=0)  # the winners' only
    pos = tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + row * s_out + pos, idx.to(tl.int64), mask=take)
    if TABLE:
        _store_table(idx, take, pos, row, slot_map_ptr, tier_map_ptr, slots_ptr, is_int8_ptr, s_table, int8_tier)


def _check(scores: torch.Tensor, k: int) -> tuple[int, int]:
    if scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError(f"scores: expected a float [rows, n] tensor, got {scores.dtype} {list(scores.shape)}")
    rows, n = scores.shape
    if not 0 < k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")
    return rows, n


def two_stage(n: int, k: int) -> bool:
    """Whether rows of n scores go through chunk candidates (long rows where k is a small fraction)."""
    return n > 2 * CHUNK and k <= CHUNK // 4


def can_select(n: int, k: int) -> bool:
    """Whether `topk_sorted` holds rows of n scores for this k in registers."""
    return triton.cdiv(n, CHUNK) * k <= MAX_BLOCKS if two_stage(n, k) else n <= MAX_BLOCKS


def topk_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [rows, k]: per row the indices of the k largest scores, ascending (ties: lower index wins)."""
    rows, n = _check(scores, k)
    if not can_select(n, k):
        raise ValueError(f"threshold top-k holds at most {MAX_BLOCKS} scores per program, got rows of {n} with k {k}")
    out = torch.empty((rows, k), dtype=torch.int64, device=scores.device)
    if two_stage(n, k):
        _two_stage(scores, k, out)
        return out
    block = max(triton.next_power_of_2(n), 128)
    _row_topk_kernel[(rows,)](scores, scores.stride(0), n, k, out, out.stride(0), out, 0, out, out, out, out, 0, 0,
                              BLOCK=block, INDEX=False, TABLE=False, num_warps=_warps(block))
    return out


def topk_gather_table(scores: torch.Tensor, k: int, index: torch.Tensor, slot_map: torch.Tensor,
                      tier_map: torch.Tensor, int8_tier: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows of a few candidates (n <= FASTER_THAN_TORCH, one launch): (selected int64 [rows, k] =
    index[row, the row's k highest scores], ascending where index rows are, slots int32 [rows, k] =
    slot_map[selected], is_int8 bool [rows, k] = tier_map[selected] == int8_tier): what index.gather(1,
    topk_sorted(scores, k)) and its block table take five launches for. index int64 [rows, n]."""
    rows, n = _check(scores, k)
    if n > FASTER_THAN_TORCH or index.shape != scores.shape or index.dtype != torch.int64:
        raise ValueError(f"topk_gather_table: rows of at most {FASTER_THAN_TORCH} scores and an int64 index of their "
                         f"shape, got scores {list(scores.shape)}, index {index.dtype} {list(index.shape)}")
    _check_maps(slot_map, tier_map, 0)
    out = torch.empty((rows, k), dtype=torch.int64, device=scores.device)
    slots = torch.empty((rows, k), dtype=torch.int32, device=scores.device)
    is_int8 = torch.empty((rows, k), dtype=torch.bool, device=scores.device)
    block = max(triton.next_power_of_2(n), 128)
    _row_topk_kernel[(rows,)](scores, scores.stride(0), n, k, out, out.stride(0), index, index.stride(0),
                              slot_map, tier_map, slots, is_int8, slots.stride(0), int8_tier,
                              BLOCK=block, INDEX=True, TABLE=True, num_warps=_warps(block))
    return out, slots, is_int8


def _check_maps(slot_map: torch.Tensor, tier_map: torch.Tensor, n: int) -> None:
    if slot_map.dtype != torch.int32 or tier_map.dtype != torch.int8 or min(slot_map.numel(), tier_map.numel()) < n:
        raise ValueError(f"slot_map int32 and tier_map int8 of >= {n} entries expected, "
                         f"got {slot_map.dtype} {list(slot_map.shape)} and {tier_map.dtype} {list(tier_map.shape)}")


def topk_block_table(scores: torch.Tensor, k: int, slot_map: torch.Tensor, tier_map: torch.Tensor,
                     int8_tier: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`topk_sorted` plus the winners' kernel block table, in the same launches:
    (selected int64 [rows, k], slots int32 [rows, k] = slot_map[selected],
    is_int8 bool [rows, k] = tier_map[selected] == int8_tier). slot_map int32 and tier_map int8, both [>= n]."""
    rows, n = _check(scores, k)
    if not two_stage(n, k) or not can_select(n, k):
        raise ValueError(f"the fused block table needs two-stage rows (n > {2 * CHUNK}, k <= {CHUNK // 4}, "
                         f"ceil(n / {CHUNK}) * k <= {MAX_BLOCKS}), got n {n}, k {k}")
    _check_maps(slot_map, tier_map, n)
    out = torch.empty((rows, k), dtype=torch.int64, device=scores.device)
    slots = torch.empty((rows, k), dtype=torch.int32, device=scores.device)
    is_int8 = torch.empty((rows, k), dtype=torch.bool, device=scores.device)
    _two_stage(scores, k, out, (slot_map, tier_map, slots, is_int8, int8_tier))
    return out, slots, is_int8


def _two_stage(scores: torch.Tensor, k: int, out: torch.Tensor, table: tuple | None = None) -> None:
    rows, n = scores.shape
    chunks = triton.cdiv(n, CHUNK)
    cand_key = torch.empty((rows, chunks * k), dtype=torch.int32, device=scores.device)  # [rows, chunks * k]
    cand_idx = torch.empty_like(cand_key)
    _chunk_topk_kernel[(chunks, rows)](scores, scores.stride(0), n, k, cand_key, cand_idx, cand_key.stride(0),
                                       CHUNK=CHUNK, num_warps=4)
    block = max(triton.next_power_of_2(chunks * k), 128)
    slot_map, tier_map, slots, is_int8, int8_tier = table or (out, out, out, out, 0)  # unused pointers without
    _merge_topk_kernel[(rows,)](cand_key, cand_idx, cand_key.stride(0), chunks * k, k, out, out.stride(0),
                                slot_map, tier_map, slots, is_int8, slots.stride(0), int8_tier,
                                BLOCK=block, TABLE=table is not None, num_warps=_warps(block))


def _warps(block: int) -> int:
    return max(4, min(32, block // 1024))


def topk_sorted_ref(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The same contract in torch: stable descending sort, first k, ascending."""
    order = torch.sort(scores.float().nan_to_num(nan=float("-inf")), dim=1, descending=True, stable=True).indices
    return torch.sort(order[:, :k], dim=1).values
