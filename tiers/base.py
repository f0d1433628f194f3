"""The tier protocol, integrity checking and the slot pool the in-memory tiers share."""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from typing import Protocol, Sequence

import torch
import xxhash

from tiers.errors import BlockMissingError, CapacityError, IntegrityError  # noqa: F401  (tiers import them from here)
from tiers.layout import BlockLayout, Blocks, QuantBlocks


def device_ints(values: Sequence[int], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Host ints as a tensor on `device`, queued without waiting for the device. torch.tensor(...,
    device="cuda") copies from pageable memory and then synchronizes the stream, draining every queued
    kernel; greedy decode queues tokens ahead of the host (Decoder.continue_greedy), so the index tensors
    of block-boundary work are staged in pinned memory instead (the caching host allocator keeps the
    buffer until the copy ran)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class Tier(Protocol):
    """What every tier offers. Block ids are global ints chosen by the store."""

    name: str
    block_bytes: int  # bytes one block occupies in this tier's format (ssd: uncompressed)

    def put(self, ids: Sequence[int], blocks: Blocks) -> None: ...
    def get(self, ids: Sequence[int]) -> Blocks: ...
    def fetch(self, ids: Sequence[int], device: torch.device) -> Blocks:
        """`get`, delivered on `device` (in the tier's format: fp16, or QuantBlocks)."""
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
    """One checksum per block of a CPU batch: `checksum` of the block's fields in order. Each field is viewed
    once as byte rows (one numpy view a field, not torch calls per block)."""
    fields = blocks.tensors() if isinstance(blocks, QuantBlocks) else (blocks,)
    if fields[0].shape[0] == 0:
        return []
    rows = [t.contiguous().view(t.shape[0], -1).view(torch.uint8).numpy() for t in fields]
    digests = []
    for i in range(fields[0].shape[0]):
        h = xxhash.xxh3_64()
        for field in rows:
            h.update(field[i])
        digests.append(h.intdigest())
    return digests


def check_ids(ids: Sequence[int], n: int, tier: str) -> None:
    if len(ids) != n:
        raise ValueError(f"{tier}.put: {len(ids)} ids for {n} blocks")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{tier}.put: duplicate block ids")


class SlotPool:
    """Block id -> slot bookkeeping over a fixed number of slots, lowest free slot first.

    Lazy: slots never used are the range [fresh, num_slots) and cost nothing, so a pool of
    billions of slots (a large cpu_bytes) is free until blocks arrive. Released slots go to
    a min-heap; they are all below `fresh`, so the heap is always drawn first."""

    def __init__(self, name: str, num_slots: int) -> None:
        self.name = name
        self.num_slots = num_slots
        self._released: list[int] = []  # a min-heap of slots below `_fresh` that are free again
        self._fresh = 0  # slots >= this were never handed out
        self.slot_of: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._released) + self.num_slots - self._fresh

    def lowest_free(self, n: int) -> list[int]:
        """The n slots the next allocate(n) would hand out, ascending (n <= num_free)."""
        reused = heapq.nsmallest(n, self._released)
        return reused + list(range(self._fresh, self._fresh + n - len(reused)))

    def can_allocate(self, n: int) -> bool:
        return self.num_free >= n

    def allocate(self, ids: Sequence[int]) -> list[int]:
        if not self.can_allocate(len(ids)):
            raise MemoryError(f"{self.name}: {len(ids)} slots wanted, {self.num_free} free")
        clash = [i for i in ids if i in self.slot_of]
        if clash:
            raise ValueError(f"{self.name}: block ids already stored: {clash[:8]}")
        slots = self.lowest_free(len(ids))
        reused = min(len(ids), len(self._released))
        for _ in range(reused):  # the same slots lowest_free named: a heap pops in ascending order
            heapq.heappop(self._released)
        self._fresh += len(ids) - reused
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
            heapq.heappush(self._released, slot)
        return slots

    def check(self) -> None:
        used = set(self.slot_of.values())
        if len(used) != len(self.slot_of):
            raise AssertionError(f"{self.name}: two blocks share a slot")
        released = set(self._released)
        if used & released or any(s >= self._fresh for s in used | released) \
                or len(used) + self.num_free != self.num_slots:
            raise AssertionError(
                f"{self.name}: free ({self.num_free}) + used ({len(used)}) != capacity ({self.num_slots})"
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
        return device_ints(self.slots.lookup(ids), self.device)

    def delete(self, ids: Sequence[int]) -> None:
        self.slots.release(ids)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.slots.slot_of

    def can_put(self, n: int) -> bool:
        return self.slots.can_allocate(n)

    def free_blocks(self) -> int:
        return self.slots.num_free

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


class DevicePoolTier(PooledTier, ABC):
    """A pooled tier on the store's device, one preallocated `pool` in its format (hot: fp16, warm: int8): a row
    per slot and, past them, `staging_blocks` rows for cold blocks fetched for one decode step (not stored here).
    A subclass builds the pool and writes `_to_format` and `_write_rows`."""

    pool: Blocks

    def __init__(self, layout: BlockLayout, block_bytes: int, capacity_bytes: int, device: torch.device | str,
                 staging_blocks: int) -> None:
        self.layout = layout
        self.block_bytes = block_bytes
        self.device = torch.device(device)
        self.slots = SlotPool(self.name, capacity_bytes // block_bytes)
        self.staging_blocks = staging_blocks

    @abstractmethod
    def _to_format(self, blocks: Blocks) -> Blocks:
        """`blocks` in the pool's format (converted on the device)."""

    @abstractmethod
    def _write_rows(self, rows: torch.Tensor | slice, blocks: Blocks) -> None:
        """pool[rows] = blocks, blocks in the pool's format on its device."""

    def put(self, ids: Sequence[int], blocks: Blocks) -> None:
        self.layout.check(blocks)
        check_ids(ids, len(blocks), self.name)
        blocks = self._to_format(blocks)
        slots = device_ints(self.slots.allocate(ids), self.device)
        self._write_rows(slots, blocks.to(self.device, non_blocking=True))

    def stage(self, blocks: Blocks) -> torch.Tensor:
        """Copy blocks in the pool's format into the staging rows; returns their slots (int32)."""
        n = len(blocks)
        if n > self.staging_blocks:
            raise ValueError(f"{self.name} tier: {n} blocks to stage, {self.staging_blocks} staging slots")
        first = self.slots.num_slots
        self._write_rows(slice(first, first + n), blocks)
        return torch.arange(first, first + n, dtype=torch.int32, device=self.device)


class BudgetedTier:
    """Shared bookkeeping of the cold tiers with a byte budget (ssd, remote, redis): each keeps
    `_used` and `_capacity` bytes and `max_value_bytes`, and defines `get()` and `num_blocks`."""

    _used: int
    _capacity: int
    max_value_bytes: int  # the most bytes one block takes in this tier (its value uncompressed)

    def fetch(self, ids: Sequence[int], device: torch.device) -> Blocks:
        return self.get(ids).to(device, non_blocking=True)

    def free_blocks(self) -> int:
        # Counted at max_value_bytes: compression only shrinks, so this never over-promises.
        return max(0, (self._capacity - self._used) // self.max_value_bytes)

    def can_put(self, n: int) -> bool:
        return n <= self.free_blocks()

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def capacity_bytes(self) -> int:
        return self._capacity
