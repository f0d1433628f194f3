"""The tier protocol, integrity checking and the slot pool the in-memory tiers share."""

from __future__ import annotations

import heapq
from typing import Protocol, Sequence

import torch
import xxhash

from tiers.errors import BlockMissingError, CapacityError, IntegrityError  # noqa: F401  (tiers import them from here)
from tiers.layout import Blocks, Int8Blocks


class Tier(Protocol):
    """What every tier offers. Block ids are global ints chosen by the store."""

    name: str
    block_bytes: int  # bytes one block occupies in this tier's format (ssd: uncompressed)

    def put(self, ids: Sequence[int], blocks: Blocks) -> None: ...
    def get(self, ids: Sequence[int]) -> Blocks: ...
    def fetch(self, ids: Sequence[int], device: torch.device) -> Blocks:
        """`get`, delivered on `device` (in the tier's format: fp16, or Int8Blocks)."""
    def delete(self, ids: Sequence[int]) -> None: ...
    def __contains__(self, block_id: int) -> bool: ...
    def can_put(self, n: int) -> bool: ...
    def free_blocks(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    @property
    def capacity_bytes(self) -> int: ...
    def check_integrity(self) -> None: ...
    def close(self) -> None: ...


def checksum(tensors: Sequence[torch.Tensor]) -> int:
    """xxh3-64 over the raw bytes of CPU tensors, in order (~10 GB/s on one core)."""
    h = xxhash.xxh3_64()
    for t in tensors:
        h.update(memoryview(t.contiguous().view(torch.uint8).numpy()))
    return h.intdigest()


def block_checksums(blocks: Blocks) -> list[int]:
    """One checksum per block of a CPU batch."""
    if isinstance(blocks, Int8Blocks):
        return [checksum(blocks.index(i).tensors()) for i in range(len(blocks))]
    return [checksum([blocks[i]]) for i in range(blocks.shape[0])]


def check_ids(ids: Sequence[int], n: int, tier: str) -> None:
    if len(ids) != n:
        raise ValueError(f"{tier}.put: {len(ids)} ids for {n} blocks")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{tier}.put: duplicate block ids")


class SlotPool:
    """Block id -> slot bookkeeping over a fixed number of slots (a free list, lowest slot first)."""

    def __init__(self, name: str, num_slots: int) -> None:
        self.name = name
        self.num_slots = num_slots
        self.free_slots: list[int] = list(range(num_slots))  # a min-heap: lowest slots are reused first
        self.slot_of: dict[int, int] = {}

    def can_allocate(self, n: int) -> bool:
        return len(self.free_slots) >= n

    def allocate(self, ids: Sequence[int]) -> list[int]:
        if not self.can_allocate(len(ids)):
            raise MemoryError(f"{self.name}: {len(ids)} slots wanted, {len(self.free_slots)} free")
        clash = [i for i in ids if i in self.slot_of]
        if clash:
            raise ValueError(f"{self.name}: block ids already stored: {clash[:8]}")
        slots = [heapq.heappop(self.free_slots) for _ in ids]
        self.slot_of.update(zip(ids, slots))
        return slots

    def lookup(self, ids: Sequence[int]) -> list[int]:
        try:
            return [self.slot_of[i] for i in ids]
        except KeyError as exc:
            raise KeyError(f"{self.name}: block {exc.args[0]} is not stored here") from None

    def release(self, ids: Sequence[int]) -> list[int]:
        slots = self.lookup(ids)
        for block_id, slot in zip(ids, slots):
            del self.slot_of[block_id]
            heapq.heappush(self.free_slots, slot)
        return slots

    def check(self) -> None:
        used = set(self.slot_of.values())
        if len(used) != len(self.slot_of):
            raise AssertionError(f"{self.name}: two blocks share a slot")
        if used & set(self.free_slots) or len(used) + len(self.free_slots) != self.num_slots:
            raise AssertionError(
                f"{self.name}: free ({len(self.free_slots)}) + used ({len(used)}) != capacity ({self.num_slots})"
            )


class PooledTier:
    """Shared bookkeeping of tiers that keep blocks in preallocated slots."""

    name: str
    block_bytes: int
    slots: SlotPool
    device: torch.device

    def fetch(self, ids: Sequence[int], device: torch.device) -> Blocks:
        return self.get(ids).to(device, non_blocking=True)

    def slot_tensor(self, ids: Sequence[int]) -> torch.Tensor:
        """Slots of `ids` as an int64 tensor on the tier's device (what kernels index with)."""
        return torch.tensor(self.slots.lookup(ids), dtype=torch.int64, device=self.device)

    def delete(self, ids: Sequence[int]) -> None:
        self.slots.release(ids)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.slots.slot_of

    def can_put(self, n: int) -> bool:
        return self.slots.can_allocate(n)

    def free_blocks(self) -> int:
        return len(self.slots.free_slots)

    @property
    def num_blocks(self) -> int:
        return len(self.slots.slot_of)

    @property
    def used_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.slots.num_slots * self.block_bytes

    def check_integrity(self) -> None:
        self.slots.check()
