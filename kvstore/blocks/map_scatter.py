"""Point entries of many block tables at new slots in one launch.

When a batch of sequences opens new tail blocks, or cooling moves blocks between tiers, each entry that
moved lives in a different table (one per sequence and layer): updating them table by table costs two
launches and a host-to-device copy per table (~50 us of host time each on an H200 host: BENCHMARKS.md,
Serving many sequences). Here the host packs (slot map address, tier map address, entry, slot) for every
entry into one int64 array, copies it once, and one launch writes them all.

Layout: kernel -> launcher -> torch reference. Imports only torch and triton.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl


@triton.jit
def _scatter_kernel(packed_ptr, n, like_slot, like_tier, tier, BLOCK: tl.constexpr):
    """packed int64 [4, n]: slot map address, tier map address, entry index, slot of each entry."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    slot_maps = tl.load(packed_ptr + offs, mask=valid, other=0).to(like_slot.dtype)
    tier_maps = tl.load(packed_ptr + n + offs, mask=valid, other=0).to(like_tier.dtype)
    index = tl.load(packed_ptr + 2 * n + offs, mask=valid, other=0)
    slot = tl.load(packed_ptr + 3 * n + offs, mask=valid, other=0)
    tl.store(slot_maps + index, slot.to(tl.int32), mask=valid)
    tl.store(tier_maps + index, tl.full((BLOCK,), tier, tl.int8), mask=valid)


def scatter_locations(maps: Sequence[tuple[torch.Tensor, torch.Tensor]], indices: Sequence[Sequence[int]],
                      slots: Sequence[Sequence[int]], tier: int) -> None:
    """For every table i: slot_map_i[indices[i][j]] = slots[i][j] and tier_map_i[...] = tier, where
    maps[i] = (slot_map int32, tier_map int8) on one device. One host-to-device copy, one launch,
    queued without waiting for the device."""
    if not maps:
        return
    slot_like, tier_like = maps[0]
    if any(s.dtype != torch.int32 or t.dtype != torch.int8 or s.device != slot_like.device for s, t in maps):
        raise ValueError("scatter_locations: int32 slot maps and int8 tier maps on one device expected")
    if any(len(i) != len(s) for i, s in zip(indices, slots)) or len(indices) != len(maps):
        raise ValueError("scatter_locations: one slot per entry index, and one list of each per table")
    addresses, tiers, flat_index, flat_slot = [], [], [], []
    for (slot_map, tier_map), idx, sl in zip(maps, indices, slots):
        if idx and max(idx) >= min(slot_map.numel(), tier_map.numel()):
            raise ValueError(f"scatter_locations: entry {max(idx)} past a table of {slot_map.numel()} entries")
        addresses += [slot_map.data_ptr()] * len(idx)
        tiers += [tier_map.data_ptr()] * len(idx)
        flat_index += idx
        flat_slot += sl
    n = len(flat_index)
    if n == 0:
        return
    host = torch.tensor([addresses, tiers, flat_index, flat_slot], dtype=torch.int64)  # [4, n]
    if slot_like.is_cuda:  # pinned, so the copy queues without draining the stream (tiers.base.device_ints)
        host = host.pin_memory().to(slot_like.device, non_blocking=True)
    _scatter_kernel[(triton.cdiv(n, 256),)](host, n, slot_like, tier_like, tier, BLOCK=256, num_warps=4)


def scatter_locations_ref(maps: Sequence[tuple[torch.Tensor, torch.Tensor]], indices: Sequence[Sequence[int]],
                          slots: Sequence[Sequence[int]], tier: int) -> None:
    """The same contract in torch, table by table."""
    for (slot_map, tier_map), idx, sl in zip(maps, indices, slots):
        if idx:
            where = torch.tensor(idx, dtype=torch.int64, device=slot_map.device)
            slot_map[where] = torch.tensor(sl, dtype=torch.int32, device=slot_map.device)
            tier_map.index_fill_(0, where, tier)
