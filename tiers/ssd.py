"""Cold SSD tier: an LMDB environment of compressed, checksummed block values.

One writer thread owns every write transaction and batches whatever puts and deletes
are queued into one commit; `put` returns once its commit is durable (LMDB's default
sync: fsync per commit). Reads open their own read transactions and are safe from any
thread. Reopening the same path finds every committed block.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future
from typing import Callable, Sequence

import lmdb
import torch

from tiers.base import BudgetedTier, check_ids
from tiers.codec import HEADER_BYTES, Codec
from tiers.layout import BlockLayout, Blocks, num_blocks
from tiers.stored import StoredBlocks, decode_tier_values

_MAX_BATCH = 256  # queued write requests folded into one transaction


class SsdTier(BudgetedTier):
    name = "ssd"

    def __init__(
        self, layout: BlockLayout, path: str, capacity_bytes: int, compression: str = "zstd",
        level: int = 1, sync: bool = True, key_prefix: bytes = b"b/",
    ) -> None:
        self.layout = layout
        self.block_bytes = layout.fp16_bytes
        self.max_value_bytes = self.block_bytes + HEADER_BYTES  # an fp16 block stored raw
        self.path = path
        self.key_prefix = key_prefix
        self._capacity = capacity_bytes
        self.codec_args = (compression, level)
        self._local = threading.local()
        self.integrity_errors = 0
        try:
            os.makedirs(path, exist_ok=True)
            self.env = lmdb.open(path, map_size=max(2 * capacity_bytes, 1 << 30), sync=sync,
                                 max_readers=256, readahead=False)
        except (OSError, lmdb.Error) as exc:
            raise ValueError(f"ssd path {path!r} is not a writable directory: {exc}") from None
        self.sizes: dict[bytes, int] = self._scan()
        self._used = sum(self.sizes.values())
        self._lock = threading.Lock()  # guards sizes/_used between callers and the writer
        # Called by the writer after each commit, in commit order, before the writers return:
        # [(key, old size or None, new value or None for a delete)]. It must not raise.
        self.on_commit: Callable[[list[tuple[bytes, int | None, bytes | None]]], None] | None = None
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kvtier-lmdb-writer", daemon=True)
        self._writer.start()

    # -- keys and codec ------------------------------------------------------------------
    def key(self, block_id: int) -> bytes:
        return self.key_prefix + block_id.to_bytes(8, "big")

    def codec(self) -> Codec:
        if not hasattr(self._local, "codec"):
            self._local.codec = Codec(*self.codec_args)
        return self._local.codec

    def _scan(self) -> dict[bytes, int]:
        # buffers=True: a value's length comes from its node; its pages are never read.
        with self.env.begin(buffers=True) as txn:
            return {bytes(k): len(v) for k, v in _prefix_items(txn.cursor(), self.key_prefix)}

    # -- protocol ------------------------------------------------------------------------
    def put(self, ids: Sequence[int], blocks: Blocks) -> None:
        self.layout.check(blocks)
        check_ids(ids, num_blocks(blocks), self.name)
        stored = [i for i in ids if i in self]
        if stored:
            raise ValueError(f"ssd: block ids already stored: {stored[:8]}")
        blocks = blocks.to("cpu")
        codec = self.codec()
        values = [codec.encode(self.layout, blocks, row) for row in range(len(ids))]
        new_bytes = sum(map(len, values))
        if self._used + new_bytes > self._capacity:
            raise MemoryError(f"ssd tier: {new_bytes} more bytes exceed the capacity of {self._capacity}")
        self.put_values([self.key(i) for i in ids], values)

    def get(self, ids: Sequence[int]) -> Blocks:
        """Decodes and verifies every block; a batch mixing fp16 and int8 blocks comes back fp16."""
        return self.fetch_as_stored(ids, "cpu").one_format()

    def fetch(self, ids: Sequence[int], device: torch.device) -> Blocks:
        return self.fetch_as_stored(ids, device).one_format()

    def fetch_as_stored(self, ids: Sequence[int], device: torch.device | str) -> StoredBlocks:
        """The blocks on `device`, each in the format it was stored in (fp16 or int8), verified where they lie in
        the map (one read transaction) and copied once into one batch per format (tiers/stored.py)."""
        with self.env.begin(buffers=True) as txn:  # the views are valid until the transaction ends
            values = [txn.get(self.key(i)) for i in ids]
            return decode_tier_values(self, self.codec(), ids, values, "ssd", device,
                                      lambda gone: KeyError(f"ssd: blocks not stored: {gone}"))

    def delete(self, ids: Sequence[int]) -> None:
        keys = [self.key(i) for i in ids]
        missing = [i for i, k in zip(ids, keys) if k not in self.sizes]
        if missing:
            raise KeyError(f"ssd: blocks not stored: {missing[:8]}")
        self.delete_keys(keys)

    def __contains__(self, block_id: int) -> bool:
        return self.key(block_id) in self.sizes

    @property
    def num_blocks(self) -> int:
        return len(self.sizes)

    def check_integrity(self) -> None:
        on_disk = self._scan()
        with self._lock:
            if on_disk != self.sizes or sum(on_disk.values()) != self._used:
                raise AssertionError("ssd tier: in-memory index disagrees with LMDB")

    def close(self) -> None:
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        self.env.close()

    # -- raw values (the sidecar service stores its own keys through these) --------------
    def put_values(self, keys: list[bytes], values: list[bytes]) -> None:
        """Stores key -> value pairs in one transaction; returns once committed."""
        self._submit([(k, v) for k, v in zip(keys, values)]).result()

    def delete_keys(self, keys: list[bytes]) -> None:
        self._submit([(k, None) for k in keys]).result()

    def get_values(self, keys: list[bytes]) -> list[bytes | None]:
        with self.env.begin(buffers=False) as txn:
            return [txn.get(k) for k in keys]

    def scan_keys(self, prefix: bytes, after: bytes = b"", limit: int | None = None) -> list[bytes]:
        """Committed keys that start with `prefix` and sort after `after`, in byte order."""
        out: list[bytes] = []
        with self.env.begin(buffers=True) as txn:
            cursor = txn.cursor()
            for key, _ in _prefix_items(cursor, prefix, after):
                if limit is not None and len(out) >= limit:
                    break
                out.append(bytes(key))
        return out

    def _submit(self, ops: list[tuple[bytes, bytes | None]]) -> Future:
        future: Future = Future()
        if not self._writer.is_alive():
            raise RuntimeError("ssd tier is closed")
        self._queue.put((ops, future))
        return future

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < _MAX_BATCH:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # finish this batch, then stop
                    break
                batch.append(nxt)
            self._commit(batch)

    def _commit(self, batch: list[tuple[list, Future]]) -> None:
        try:
            with self.env.begin(write=True) as txn:
                for ops, _ in batch:
                    for key, value in ops:
                        if value is None:
                            txn.delete(key)
                        else:
                            txn.put(key, value)
        except lmdb.Error as exc:
            for _, future in batch:
                future.set_exception(RuntimeError(f"ssd tier: LMDB write failed: {exc}"))
            return
        changes = []
        with self._lock:
            for ops, _ in batch:
                for key, value in ops:
                    old = self.sizes.pop(key, None)
                    self._used -= old or 0
                    if value is not None:
                        self.sizes[key] = len(value)
                        self._used += len(value)
                    changes.append((key, old, value))
        if self.on_commit is not None:
            self.on_commit(changes)
        for _, future in batch:
            future.set_result(None)


def _prefix_items(cursor: lmdb.Cursor, prefix: bytes, after: bytes = b""):
    """(key, value) pairs of `cursor` whose key starts with `prefix` and sorts after `after`."""
    start = max(prefix, after + b"\0") if after else prefix
    if not cursor.set_range(start):
        return
    for key, value in cursor:
        if bytes(key[: len(prefix)]) != prefix:
            return
        yield key, value
