"""Per-row top-k indices, sorted ascending, by threshold selection in Triton (no host sync).

torch.topk + torch.sort over [kv_heads, num_blocks] costs ~80 us at 1M tokens whatever the
block count (several radix passes, each a launch), more than the Quest scan itself. Here a
program keeps a run of scores in registers, bisects on the order-preserving integer image of
the floats for the k-th largest value, and compacts the winners with a prefix sum: indices come
out already ascending, ties broken by the lower index (torch's stable sort order).

One program per row holding the whole row used only kv_heads SMs and took 95 us per layer at
1M tokens (17K blocks; bench_longctx/results/h200-profile). Long rows therefore go in two
stages: every CHUNK scores of a row keep their own top k (two-stage rows have k <= CHUNK / 4; the
global top k is always among them), then one program per row selects k of the
ceil(n / CHUNK) * k candidates, which sit in ascending index order, so the same compaction
gives ascending indices. Stage two can also write the kernel block table of the winners
(slot_map[i], tier_map[i] == int8_tier), which saves the decode step three gather launches.
QuestSelect folds both stages into the Quest scan (one launch): the last tile of a chunk to be
scored selects the chunk's candidates, the last chunk of a head merges them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from eviction.quest_kernel import _quest_tile, check_live_inputs

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
def _kth_key(key, k, BITS: tl.constexpr):
    """The k-th largest key, its bits decided from the top on the unsigned image key ^ 0x80000000 (no 64-bit
    midpoint in the passes' dependency chain): 32 / BITS counting passes, each counting the keys at or above
    the 2^BITS extensions of the prefix in one reduction. (A radix select, four 8-bit histogram passes, took
    3x longer in the merge stage on the H200, and a 4-way search whose passes took three reductions 1.4x
    longer: results/h200-profile.)"""
    t = tl.full((), 0, tl.uint32)  # invariant: count(key >= t) >= k
    if BITS == 1:
        bit = tl.full((), 0x80000000, tl.uint32)
        for _ in range(32):
            cand = t | bit
            count = tl.sum((key >= (cand ^ 0x80000000).to(tl.int32, bitcast=True)).to(tl.int32), axis=0)
            t = tl.where(count >= k, cand, t)
            bit = bit >> 1
    else:
        digit = tl.arange(0, 1 << BITS).to(tl.uint32)  # [2^BITS]
        shift = tl.full((), 32 - BITS, tl.uint32)
        for _ in range(32 // BITS):
            marks = ((t | (digit << shift)) ^ 0x80000000).to(tl.int32, bitcast=True)  # [2^BITS] ascending
            counts = tl.sum((key[:, None] >= marks[None, :]).to(tl.int32), axis=0)  # non-increasing
            t = t | ((tl.sum((counts >= k).to(tl.uint32), axis=0) - 1) << shift)  # counts[0] >= k always
            shift = shift - BITS
    return (t ^ 0x80000000).to(tl.int32, bitcast=True)


@triton.jit
def _first_k_from(key, k, t):
    """bool mask of the keys above t, then of the first keys equal to t, k in all (t: the k-th largest key)."""
    above = key > t
    tied = key == t
    need = k - tl.sum(above.to(tl.int32), axis=0)
    return above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= need))


@triton.jit
def _winners(key, k, BITS: tl.constexpr):
    """bool mask of the k largest keys (ties: the first in order), for a block holding >= k entries."""
    return _first_k_from(key, k, _kth_key(key, k, BITS))


@triton.jit
def _row_topk_kernel(scores_ptr, s_row, n, k, out_ptr, s_out, BLOCK: tl.constexpr):
    """One program per row: the row's k winners, ascending."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    valid = offs < n
    x = tl.load(scores_ptr + row * s_row + offs, mask=valid, other=float("-inf")).to(tl.float32)
    take = _winners(_keys(x, valid), k, 1) & valid
    pos = tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + row * s_out + pos, offs.to(tl.int64), mask=take)


@triton.jit
def _chunk_candidates(scores_row, n, chunk, k, cand_key_row, cand_idx_row, bound_ptr, CHUNK: tl.constexpr,
                      BITS: tl.constexpr, BOUND: tl.constexpr):
    """Stage one for one row's chunk: its k winners (padding past n included, keyed lowest) at candidate slots
    [chunk * k, chunk * k + k), ascending. Loads bypass L1: the fused kernel reads scores other programs wrote.
    BOUND: bound_ptr holds a lower bound of the row's k-th key (the largest k-th key of the chunks searched so
    far; any value it held is one): a chunk with fewer than k keys at or above it keeps just those, no search,
    and pads its other slots with the lowest key; a chunk that searches raises the bound to its k-th key."""
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = offs < n
    x = tl.load(scores_row + offs, mask=valid, other=float("-inf"), cache_modifier=".cg").to(tl.float32)
    key = _keys(x, valid)
    if BOUND:
        alive = key >= tl.load(bound_ptr, volatile=True)  # keys below it lose to k others
        if tl.sum(alive.to(tl.int32), axis=0) < k:
            take = alive
        else:
            t = _kth_key(key, k, BITS)
            tl.atomic_max(bound_ptr, t, sem="relaxed")
            take = _first_k_from(key, k, t)
        slot = tl.arange(0, CHUNK)
        pad = (slot >= tl.sum(take.to(tl.int32), axis=0)) & (slot < k)
        tl.store(cand_key_row + chunk * k + slot, tl.full((CHUNK,), -2147483647 - 1, tl.int32), mask=pad)
    else:
        take = _winners(key, k, BITS)  # exactly k entries: the chunk always holds CHUNK >= k
    pos = chunk * k + tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(cand_key_row + pos, key, mask=take)
    tl.store(cand_idx_row + pos, offs, mask=take)


@triton.jit
def _merge_candidates(cand_key_row, cand_idx_row, num_cand, k, out_row, slot_map_ptr, tier_map_ptr, slots_row,
                      is_int8_row, int8_tier, BLOCK: tl.constexpr, TABLE: tl.constexpr, BITS: tl.constexpr):
    """Stage two for one row: k winners of the candidates, ascending; with TABLE their block table."""
    offs = tl.arange(0, BLOCK)
    valid = offs < num_cand
    key = tl.load(cand_key_row + offs, mask=valid, other=-2147483647 - 1, cache_modifier=".cg")
    take = _winners(key, k, BITS) & valid
    idx = tl.load(cand_idx_row + offs, mask=take, other=0, cache_modifier=".cg")  # the winners' only
    pos = tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(out_row + pos, idx.to(tl.int64), mask=take)
    if TABLE:
        slot = tl.load(slot_map_ptr + idx, mask=take, other=0)
        tier = tl.load(tier_map_ptr + idx, mask=take, other=0)
        tl.store(slots_row + pos, slot, mask=take)
        tl.store(is_int8_row + pos, tier == int8_tier, mask=take)


@triton.jit
def _chunk_topk_kernel(scores_ptr, s_row, n, k, cand_key_ptr, cand_idx_ptr, s_cand, CHUNK: tl.constexpr):
    """Stage one, program (chunk, row)."""
    row = tl.program_id(1)
    _chunk_candidates(scores_ptr + row * s_row, n, tl.program_id(0), k, cand_key_ptr + row * s_cand,
                      cand_idx_ptr + row * s_cand, cand_key_ptr, CHUNK, 1, False)


@triton.jit
def _merge_topk_kernel(cand_key_ptr, cand_idx_ptr, s_cand, num_cand, k, out_ptr, s_out,
                       slot_map_ptr, tier_map_ptr, slots_ptr, is_int8_ptr, s_table, int8_tier,
                       BLOCK: tl.constexpr, TABLE: tl.constexpr, BITS: tl.constexpr = 1):
    """Stage two, one program per row."""
    row = tl.program_id(0)
    _merge_candidates(cand_key_ptr + row * s_cand, cand_idx_ptr + row * s_cand, num_cand, k, out_ptr + row * s_out,
                      slot_map_ptr, tier_map_ptr, slots_ptr + row * s_table, is_int8_ptr + row * s_table, int8_tier,
                      BLOCK, TABLE, BITS)


@triton.jit(do_not_specialize=["num_blocks", "sink_blocks", "recent", "block_tokens"])  # one compile per decode run
def _quest_topk_kernel(q_ptr, s_ptr, scores_ptr, count_ptr, num_blocks, sink_blocks, recent, block_tokens,
                       stride_qh, stride_sn, stride_sm, stride_sh, stride_oh, k, num_chunks, cand_key_ptr,
                       cand_idx_ptr, s_cand, arrivals_ptr, out_ptr, s_out, slot_map_ptr, tier_map_ptr, slots_ptr,
                       is_int8_ptr, int8_tier, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
                       GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, MERGE_BLOCK: tl.constexpr, MERGE: tl.constexpr,
                       SEARCH_BITS: tl.constexpr):
    """Program = (tile of BLOCK_N blocks, kv head), heads fastest so that neighbouring programs read one
    contiguous run of summaries. Each writes its Quest scores; the last tile of a chunk to finish selects the
    chunk's k candidates; the last chunk of a head to finish merges them into the head's block table."""
    head = tl.program_id(0) % NUM_HEADS
    tile = tl.program_id(0) // NUM_HEADS
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    score = _quest_tile(q_ptr, s_ptr, count_ptr, offs_n, head, num_blocks, sink_blocks, recent, block_tokens,
                        stride_qh, stride_sn, stride_sm, stride_sh, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, BLOCK_N,
                        True, True, True)
    row = scores_ptr + head * stride_oh
    tl.store(row + offs_n, score, mask=offs_n < num_blocks)
    chunk = tile // (CHUNK // BLOCK_N)
    chunk_tiles = tl.minimum(CHUNK // BLOCK_N, tl.cdiv(num_blocks, BLOCK_N) - chunk * (CHUNK // BLOCK_N))
    tl.debug_barrier()  # every thread's scores are stored before the release below publishes them
    arrived = tl.atomic_add(arrivals_ptr + head * num_chunks + chunk, 1, sem="acq_rel", scope="gpu")
    if arrived == chunk_tiles - 1:
        tl.store(arrivals_ptr + head * num_chunks + chunk, 0)  # zero again for the next launch
        bound_ptr = arrivals_ptr + NUM_HEADS * num_chunks + NUM_HEADS + head
        _chunk_candidates(row, num_blocks, chunk, k, cand_key_ptr + head * s_cand, cand_idx_ptr + head * s_cand,
                          bound_ptr, CHUNK, SEARCH_BITS, True)
        tl.debug_barrier()
        done = tl.atomic_add(arrivals_ptr + NUM_HEADS * num_chunks + head, 1, sem="acq_rel", scope="gpu")
        if done == num_chunks - 1:
            tl.store(arrivals_ptr + NUM_HEADS * num_chunks + head, 0)
            tl.store(bound_ptr, -2147483647 - 1)
            if MERGE:
                _merge_candidates(cand_key_ptr + head * s_cand, cand_idx_ptr + head * s_cand, num_chunks * k, k,
                                  out_ptr + head * s_out, slot_map_ptr, tier_map_ptr, slots_ptr + head * s_out,
                                  is_int8_ptr + head * s_out, int8_tier, MERGE_BLOCK, True, SEARCH_BITS)


def _check(scores: torch.Tensor, k: int) -> tuple[int, int]:
    if scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError(f"scores: expected a float [rows, n] tensor, got {scores.dtype} {list(scores.shape)}")
    rows, n = scores.shape
    if not 0 < k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")
    return rows, n


def _check_maps(slot_map: torch.Tensor, tier_map: torch.Tensor, n: int) -> None:
    if slot_map.dtype != torch.int32 or tier_map.dtype != torch.int8 or min(slot_map.numel(), tier_map.numel()) < n:
        raise ValueError(f"slot_map int32 and tier_map int8 of >= {n} entries expected, "
                         f"got {slot_map.dtype} {list(slot_map.shape)} and {tier_map.dtype} {list(tier_map.shape)}")


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
    _row_topk_kernel[(rows,)](scores, scores.stride(0), n, k, out, out.stride(0), BLOCK=block,
                              num_warps=_warps(block))
    return out


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


@dataclass
class QuestSelect:
    """The captured decode step's topk select in one launch: exactly topk_block_table(quest_scores_live(...)),
    the top-k stages folded into the Quest scan. Built once per decode step (it owns the launch's workspace:
    arrival counters and per-head bounds that every launch leaves as it found them, and the candidates), called
    per layer in stream order.
    Settings: bench_longctx/select_variants.py (maxnreg caps registers for the scan's occupancy; the selecting
    programs, a few per launch, may spill)."""

    capacity: int  # blocks of every table: summaries [capacity, 2, kv_heads, head_dim]
    num_kv_heads: int
    k: int
    device: torch.device | str
    chunk: int = CHUNK
    block_n: int = 64
    num_warps: int = 8
    maxnreg: int | None = 48
    merge_in_kernel: bool = True
    search_bits: int = 2  # bits of the k-th key decided per counting pass: 1, 2 or 4

    def __post_init__(self) -> None:
        if self.search_bits not in (1, 2, 4):
            raise ValueError(f"search_bits must be 1, 2 or 4, got {self.search_bits}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1) or self.chunk % self.block_n:
            raise ValueError(f"block_n must be a power of two >= 16 dividing chunk, got {self.block_n}, {self.chunk}")
        self.num_chunks = triton.cdiv(self.capacity, self.chunk)
        if not 0 < self.k <= min(self.chunk, self.capacity) or self.num_chunks * self.k > MAX_BLOCKS:
            raise ValueError(f"QuestSelect needs k in [1, min(chunk, capacity)] and ceil(capacity / chunk) * k <= "
                             f"{MAX_BLOCKS}, got capacity {self.capacity}, chunk {self.chunk}, k {self.k}")
        h, c = self.num_kv_heads, self.num_chunks
        self.arrivals = torch.zeros(h * c + 2 * h, dtype=torch.int32, device=self.device)  # tiles per chunk,
        self.arrivals[h * c + h:] = -(2**31)  # chunks per head, lower bounds of each head's k-th key
        self.cand_key = torch.empty((h, c * self.k), dtype=torch.int32, device=self.device)  # [H, chunks * k]
        self.cand_idx = torch.empty_like(self.cand_key)

    def check_integrity(self) -> None:
        """Between launches the workspace is as each launch expects it: counters zero, bounds lowest."""
        h, c = self.num_kv_heads, self.num_chunks
        if bool(self.arrivals[: h * c + h].any()) or bool((self.arrivals[h * c + h:] != -(2**31)).any()):
            raise AssertionError(f"QuestSelect workspace not reset: {self.arrivals.tolist()}")

    def __call__(self, q: torch.Tensor, summaries: torch.Tensor, count: torch.Tensor, slot_map: torch.Tensor,
                 tier_map: torch.Tensor, int8_tier: int, *, block_tokens: int, sink_blocks: int,
                 recent_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(selected int64 [H, k] ascending, slots int32 [H, k], is_int8 bool [H, k], scores float32 [H, capacity]);
        arguments as quest_scores_live's and topk_block_table's (summaries of exactly capacity blocks)."""
        n, h, group = check_live_inputs(q, summaries, count)
        if (n, h, q.device) != (self.capacity, self.num_kv_heads, self.arrivals.device):
            raise ValueError(f"summaries: expected [{self.capacity}, 2, {self.num_kv_heads}, head_dim] (capacity "
                             f"blocks) on {self.arrivals.device}, got {list(summaries.shape)} on {q.device}")
        _check_maps(slot_map, tier_map, n)
        scores = torch.empty((h, n), dtype=torch.float32, device=q.device)  # [H, N]
        out = torch.empty((h, self.k), dtype=torch.int64, device=q.device)  # [H, k]
        slots = torch.empty((h, self.k), dtype=torch.int32, device=q.device)
        is_int8 = torch.empty((h, self.k), dtype=torch.bool, device=q.device)
        merge_block = max(triton.next_power_of_2(self.num_chunks * self.k), 128)
        head_dim = summaries.shape[3]
        _quest_topk_kernel[(triton.cdiv(n, self.block_n) * h,)](
            q, summaries, scores, count, n, sink_blocks, recent_tokens, block_tokens, q.stride(0),
            summaries.stride(0), summaries.stride(1), summaries.stride(2), scores.stride(0), self.k, self.num_chunks,
            self.cand_key, self.cand_idx, self.cand_key.stride(0), self.arrivals, out, out.stride(0), slot_map,
            tier_map, slots, is_int8, int8_tier, NUM_HEADS=h, GROUP=group,
            GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=self.block_n, CHUNK=self.chunk,
            MERGE_BLOCK=merge_block, MERGE=self.merge_in_kernel, SEARCH_BITS=self.search_bits,
            num_warps=self.num_warps, **({} if self.maxnreg is None else {"maxnreg": self.maxnreg}),
        )  # fmt: skip
        if not self.merge_in_kernel:
            _merge_topk_kernel[(h,)](self.cand_key, self.cand_idx, self.cand_key.stride(0), self.num_chunks * self.k,
                                     self.k, out, out.stride(0), slot_map, tier_map, slots, is_int8, slots.stride(0),
                                     int8_tier, BLOCK=merge_block, TABLE=True, BITS=self.search_bits,
                                     num_warps=_warps(merge_block))
        return out, slots, is_int8, scores
