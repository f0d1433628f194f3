"""The cpu tier's host-side row copies and xxh3 checks: what a CpuTier does without block sums on a GPU
(no CUDA, or checksums="host"), and its host gathers for get(). A mixin of tiers/cpu.py's CpuTier, whose
state (slots, slabs, their numpy byte views, sums) it reads.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import xxhash

from tiers.base import IntegrityError, block_checksums
from tiers.block_rows import copy_rows, row_slice
from tiers.layout import Blocks

_CHUNK_BYTES = 8 << 20  # gathered (and, on the host, verified) as one piece


class HostRows:
    def _verify(self, ids: Sequence[int], slots: list[int], lo: int, hi: int) -> None:
        """xxh3 of stored rows, hashed in place through numpy views: no torch call per block, so
        worker threads hold the GIL only briefly (xxhash releases it while hashing)."""
        digests = self._digests()
        for block_id, slot in zip(ids[lo:hi], slots[lo:hi]):
            views, row = self._byte_views[slot // self.slab_blocks], slot % self.slab_blocks
            if len(views) == 1:  # fp16: one buffer; the one-shot digest equals the streaming one
                digest = xxhash.xxh3_64_intdigest(views[0][row])
            else:
                h = xxhash.xxh3_64()
                for rows in views:
                    h.update(rows[row])
                digest = h.intdigest()
            if digest != digests[slot]:
                self.integrity_errors += 1
                raise IntegrityError(f"cpu tier: block {block_id} failed its checksum")

    def _digests(self) -> np.ndarray:
        """The xxh3 digest of every slot: a uint64 numpy view of sums[:, 0]."""
        return self.sums.numpy()[:, 0].view(np.uint64)

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        step = max(1, _CHUNK_BYTES // self.block_bytes)
        return [(lo, min(lo + step, n)) for lo in range(0, n, step)]

    def _gather(self, ids: Sequence[int], out: Blocks, verify: bool) -> list[int]:
        """Fill host batch `out` with `ids`, in chunks on a thread pool (with `verify`, each checked by
        xxh3); returns their slots."""
        slots = self.slots.lookup(ids)
        chunks = self._chunks(len(ids))
        if len(chunks) <= 1:  # no thread hand-off for one chunk
            for lo, hi in chunks:
                self._gather_chunk(ids, slots, out, lo, hi, verify)
            return slots
        futures = [self._pool().submit(self._gather_chunk, ids, slots, out, lo, hi, verify) for lo, hi in chunks]
        for future in futures:
            future.result()
        return slots

    def _gather_chunk(self, ids: Sequence[int], slots: list[int], out: Blocks, lo: int, hi: int,
                      verify: bool) -> None:
        index, groups = self._plan(slots[lo:hi])
        for slab, cols in groups:
            copy_rows(self.slabs[slab], index[1, cols], out, index[2, cols] + lo)
        if not verify:
            return
        digests = self._digests()
        for block_id, slot, got in zip(ids[lo:hi], slots[lo:hi], block_checksums(row_slice(out, lo, hi))):
            if got != digests[slot]:
                self.integrity_errors += 1
                raise IntegrityError(f"cpu tier: block {block_id} failed its checksum")

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            # 4 threads: host-side hashing peaks there on the H200 host (BENCHMARKS.md, Tiers)
            self._executor = ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="kvtier-cpu")
        return self._executor
