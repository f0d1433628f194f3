"""Cold CPU tier: host memory (pinned when CUDA exists), fp16 or int8, checksummed.

Memory comes in slabs allocated on first use, so a large `cpu_bytes` costs nothing
until blocks arrive, and `psutil` refuses a slab that would push free host memory
below the reserve (the store then spills to ssd instead of being OOM-killed).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Sequence

import psutil
import torch

import xxhash

from tiers.base import IntegrityError, PooledTier, SlotPool, block_checksums, check_ids
from tiers.fetch_kernel import gather_rows
from tiers.layout import BlockLayout, Blocks, Int8Blocks
from tiers.quant import dequantize, quantize

_SLAB_BYTES = 256 << 20
_CHUNK_BYTES = 8 << 20  # gathered, verified and sent over PCIe as one piece


class CpuTier(PooledTier):
    name = "cpu"

    def __init__(
        self, layout: BlockLayout, capacity_bytes: int, dtype: str = "float16",
        pin: bool | None = None, memory_reserve: int = 2 << 30,
    ) -> None:
        self.layout = layout
        self.dtype = dtype
        self.block_bytes = layout.bytes_for(dtype)
        self.device = torch.device("cpu")
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.memory_reserve = memory_reserve
        self.slots = SlotPool(self.name, capacity_bytes // self.block_bytes)
        self.slab_blocks = max(1, min(self.slots.num_slots, _SLAB_BYTES // self.block_bytes))
        self.slabs: list[Blocks] = []
        self._byte_views: list[list] = []  # per slab, numpy [rows, bytes] views of its tensors
        self.checksums: dict[int, int] = {}
        self.integrity_errors = 0
        self._executor: ThreadPoolExecutor | None = None

    # -- memory --------------------------------------------------------------------------
    def _slabs_needed(self, n: int) -> int:
        """Slabs to allocate so that the n lowest free slots exist."""
        if n == 0:
            return 0
        highest = self.slots.lowest_free(n)[-1]
        return max(0, highest // self.slab_blocks + 1 - len(self.slabs))

    def can_put(self, n: int) -> bool:
        if not self.slots.can_allocate(n):
            return False
        new_bytes = self._slabs_needed(n) * self.slab_blocks * self.block_bytes
        return new_bytes == 0 or psutil.virtual_memory().available - new_bytes >= self.memory_reserve

    def free_blocks(self) -> int:
        """Free slots in existing slabs plus those in slabs host memory still allows."""
        allocated = len(self.slabs) * self.slab_blocks
        in_slabs = allocated - self.num_blocks  # used slots all lie in allocated slabs
        slab_bytes = self.slab_blocks * self.block_bytes
        spare = max(0, psutil.virtual_memory().available - self.memory_reserve) // slab_bytes
        return min(self.slots.num_free, in_slabs + spare * self.slab_blocks)

    def _grow_to(self, slot: int) -> None:
        while len(self.slabs) <= slot // self.slab_blocks:
            empty = self.layout.empty_fp16 if self.dtype == "float16" else self.layout.empty_int8
            self.slabs.append(empty(self.slab_blocks, "cpu", pin=self.pin))
            fields = self.slabs[-1].tensors() if self.dtype == "int8" else (self.slabs[-1],)
            self._byte_views.append([_flat(t) for t in fields])  # [rows, bytes] uint8 numpy views

    # -- protocol ------------------------------------------------------------------------
    def put(self, ids: Sequence[int], blocks: Blocks) -> None:
        self.layout.check(blocks)
        check_ids(ids, len(blocks), self.name)
        if not self.can_put(len(ids)):
            raise MemoryError(f"cpu tier: no room for {len(ids)} blocks (capacity or host memory reserve)")
        blocks = self._convert(blocks).to("cpu")
        sums = block_checksums(blocks)
        slots = self.slots.allocate(ids)
        self.checksums.update(zip(ids, sums))
        self._grow_to(max(slots))
        for slab, (rows, positions) in self._by_slab(slots).items():
            _copy_rows(blocks, positions, self.slabs[slab], rows)

    def get(self, ids: Sequence[int]) -> Blocks:
        """Gathers `ids` into one (pinned) batch, verifying every block's checksum."""
        out = self._empty(len(ids))
        for _ in self._gather_chunks(ids, out):
            pass
        return out

    def fetch(self, ids: Sequence[int], device: torch.device | str) -> Blocks:
        """`get` straight into `device` memory, verified. From pinned slabs the GPU gathers the rows
        itself in one launch per slab while worker threads verify the checksums of the same rows."""
        device = torch.device(device)
        if device.type == "cpu":
            return self.get(ids)
        slots = self.slots.lookup(ids)
        empty = self.layout.empty_fp16 if self.dtype == "float16" else self.layout.empty_int8
        out = empty(len(ids), device)
        if not self.pin:  # pageable host memory: gather and verify on the host, then copy
            staging = self._empty(len(ids))
            for lo, hi in self._gather_chunks(ids, staging):
                _copy_slice(staging, out, lo, hi)
            return out
        checks = [self._pool().submit(self._verify, ids, slots, lo, hi) for lo, hi in self._chunks(len(ids))]
        for slab, (rows, positions) in self._by_slab(slots).items():
            _gather_to_device(self.slabs[slab], rows.to(device), out, positions.to(device))
        for check in checks:
            check.result()  # raises IntegrityError: the gathered copy is dropped, never returned
        return out

    def _verify(self, ids: Sequence[int], slots: list[int], lo: int, hi: int) -> None:
        """Checksums of stored rows, hashed in place through numpy views: no torch call per block, so
        worker threads hold the GIL only briefly (xxhash releases it while hashing)."""
        for block_id, slot in zip(ids[lo:hi], slots[lo:hi]):
            views, row = self._byte_views[slot // self.slab_blocks], slot % self.slab_blocks
            if len(views) == 1:  # fp16: one buffer; the one-shot digest equals the streaming one
                digest = xxhash.xxh3_64_intdigest(views[0][row])
            else:
                h = xxhash.xxh3_64()
                for rows in views:
                    h.update(rows[row])
                digest = h.intdigest()
            if digest != self.checksums[block_id]:
                self.integrity_errors += 1
                raise IntegrityError(f"cpu tier: block {block_id} failed its checksum")

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        step = max(1, _CHUNK_BYTES // self.block_bytes)
        return [(lo, min(lo + step, n)) for lo in range(0, n, step)]

    def _empty(self, n: int) -> Blocks:
        empty = self.layout.empty_fp16 if self.dtype == "float16" else self.layout.empty_int8
        return empty(n, "cpu", pin=self.pin)

    def _gather_chunks(self, ids: Sequence[int], out: Blocks) -> Iterator[tuple[int, int]]:
        """Fill `out` with `ids` in chunks on a thread pool; yields each verified (lo, hi) in order."""
        slots = self.slots.lookup(ids)
        chunks = self._chunks(len(ids))
        if len(chunks) <= 1:
            for lo, hi in chunks:
                self._gather_verify(ids, slots, out, lo, hi)
                yield lo, hi
            return
        futures = [self._pool().submit(self._gather_verify, ids, slots, out, lo, hi) for lo, hi in chunks]
        for (lo, hi), future in zip(chunks, futures):
            future.result()
            yield lo, hi

    def _gather_verify(self, ids: Sequence[int], slots: list[int], out: Blocks, lo: int, hi: int) -> None:
        for slab, (rows, positions) in self._by_slab(slots[lo:hi]).items():
            _copy_rows(self.slabs[slab], rows, out, positions + lo)
        for block_id, got in zip(ids[lo:hi], block_checksums(_slice(out, lo, hi))):
            if got != self.checksums[block_id]:
                self.integrity_errors += 1
                raise IntegrityError(f"cpu tier: block {block_id} failed its checksum")

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            # 4 threads: host-side hashing peaked there on the H200 host (results/hash_threads_h200.txt)
            self._executor = ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="kvtier-cpu")
        return self._executor

    def delete(self, ids: Sequence[int]) -> None:
        self.slots.release(ids)
        for block_id in ids:
            del self.checksums[block_id]

    def check_integrity(self) -> None:
        self.slots.check()
        if self.checksums.keys() != self.slots.slot_of.keys():
            raise AssertionError("cpu tier: checksum table and slot table disagree")

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()
        self.slabs.clear()
        self._byte_views.clear()

    # -- helpers -------------------------------------------------------------------------
    def _convert(self, blocks: Blocks) -> Blocks:
        if self.dtype == "float16" and isinstance(blocks, Int8Blocks):
            return dequantize(blocks)
        if self.dtype == "int8" and not isinstance(blocks, Int8Blocks):
            return quantize(blocks)
        return blocks

    def _by_slab(self, slots: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """slab -> (rows inside the slab, positions in the batch)."""
        groups: dict[int, tuple[list[int], list[int]]] = {}
        for pos, slot in enumerate(slots):
            rows, positions = groups.setdefault(slot // self.slab_blocks, ([], []))
            rows.append(slot % self.slab_blocks)
            positions.append(pos)
        return {slab: (torch.tensor(r), torch.tensor(p)) for slab, (r, p) in groups.items()}


def _copy_rows(src: Blocks, src_rows: torch.Tensor, dst: Blocks, dst_rows: torch.Tensor) -> None:
    """dst[dst_rows] = src[src_rows] for either block format. Row copies through numpy: torch's
    5-D indexing on CPU is ~50x slower and its thread pool stalls when cores are contended."""
    pairs = zip(dst.tensors(), src.tensors()) if isinstance(src, Int8Blocks) else [(dst, src)]
    s_idx, d_idx = src_rows.numpy(), dst_rows.numpy()
    for d, s in pairs:
        d2, s2 = _flat(d), _flat(s)
        d2[d_idx] = s2[s_idx]


def _flat(t: torch.Tensor):
    """A [rows, bytes] uint8 numpy view of a CPU tensor."""
    return t.view(t.shape[0], -1).view(torch.uint8).numpy()


def _slice(blocks: Blocks, lo: int, hi: int) -> Blocks:
    return blocks.index(slice(lo, hi)) if isinstance(blocks, Int8Blocks) else blocks[lo:hi]


def _copy_slice(src: Blocks, dst: Blocks, lo: int, hi: int) -> None:
    pairs = zip(dst.tensors(), src.tensors()) if isinstance(src, Int8Blocks) else [(dst, src)]
    for d, s in pairs:
        d[lo:hi].copy_(s[lo:hi], non_blocking=True)


def _gather_to_device(slab: Blocks, rows: torch.Tensor, out: Blocks, positions: torch.Tensor) -> None:
    """out[positions] = slab[rows], the GPU reading the pinned slab directly."""
    pairs = zip(out.tensors(), slab.tensors()) if isinstance(slab, Int8Blocks) else [(out, slab)]
    for d, s in pairs:
        words = s.view(s.shape[0], -1).view(torch.int32)
        if len(positions) == d.shape[0]:  # one slab holds every block: gather in place
            gather_rows(words, rows, d.view(d.shape[0], -1).view(torch.int32))
        else:
            part = torch.empty((len(rows), words.shape[1]), dtype=torch.int32, device=d.device)
            gather_rows(words, rows, part)
            d.view(d.shape[0], -1).view(torch.int32).index_copy_(0, positions, part)
