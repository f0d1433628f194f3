"""Shared cold tier on Redis, Valkey or a Redis Cluster: one key, one value, one SET per block.

    key    <namespace>:<block id as 16 hex digits>           namespace: a per-store prefix
    value  envelope  magic b"KVRB", block id u64, key length u16, key bytes   (little endian)
           + a tiers/codec.py value (header, raw or zstd payload, xxh3-64), whose checksum
             covers the envelope too

Header, payload and checksum are one value written by one command, so Redis evicts a block
whole or not at all (LMCache's legacy layout keeps data and metadata in two keys and Redis
can evict one without the other). Every get verifies the checksum: a damaged, truncated or
foreign value, or one copied under another key or namespace, raises IntegrityError and
counts in `integrity_errors`; it is never returned. A key Redis evicted (maxmemory) raises
BlockMissingError (a KeyError) naming the ids, counted in `missing_blocks`.

Keys carry no hash tags: a batch is a pipeline of single-key commands, which the cluster
client splits per shard, so blocks spread over every slot. The URL decides the client: a
node that reports `cluster_enabled:1` is opened as a cluster.

Sharing: a private tier (shared=False; namespace `kvtier:<random>` unless named) deletes the
keys of what it deletes and everything left on close(), and never overwrites a key it did not
write (SET NX: the batch is undone, ValueError). Keys a failed put may have written (a timeout or a
server killed mid-pipeline loses the replies, not the SETs) are its own leftovers: never served, a
later put of those ids overwrites them (plain SET), close() deletes them. A shared tier
(shared=True, a namespace other processes also name) never deletes from Redis: its ids must name
the same content fleet-wide (e.g. content hashes); a put whose key already exists stores nothing
and adopts the block there (stored once), its own leftovers included; `attach(ids)` adopts blocks
another process wrote. Redis's own maxmemory policy removes them.
A put returns after Redis acknowledged every SET: durable on restart only if the server runs
`appendonly yes` with `appendfsync always` (docs/redis.md).
"""

from __future__ import annotations

import re
import struct
import threading
import uuid
import warnings
from contextlib import closing
from typing import Callable, Iterator, Sequence

from tiers.base import BlockMissingError, BudgetedTier, IntegrityError, check_ids
from tiers.codec import HEADER_BYTES, Codec
from tiers.layout import BlockLayout, Blocks, num_blocks
from tiers.redis_batch import InPlaceBatch
from tiers.redis_wire import SlotsMoved, about_key_or_memory, connect, get_replies, pipelined, pipelined_gets

_ENVELOPE = struct.Struct("<4sQH")
_MAGIC = b"KVRB"
_NAMESPACE = re.compile(r"[A-Za-z0-9_.:-]{1,200}")  # no braces: no accidental hash tags
_BATCH_BYTES = 32 << 20  # one pipeline carries at most this much value data (and each thread a buffer this big)
_GET_WINDOW_BYTES = 8 << 20  # GET replies read per master between sends: 8 beat 32 MiB (BENCHMARKS.md, Redis)


class RedisTier(BudgetedTier):
    name = "redis"

    def __init__(
        self, layout: BlockLayout, url: str, capacity_bytes: int, namespace: str | None = None,
        shared: bool = False, compression: str = "none", level: int = 1, timeout: float = 30.0,
    ) -> None:
        if namespace is not None and not _NAMESPACE.fullmatch(namespace):
            raise ValueError(f"redis namespace must match {_NAMESPACE.pattern}, got {namespace!r}")
        if shared and namespace is None:
            raise ValueError("a shared redis tier needs a namespace the other processes also name")
        self.layout = layout
        self.block_bytes = layout.fp16_bytes
        self.namespace = namespace or f"kvtier:{uuid.uuid4().hex[:16]}"
        self.shared = shared
        self._capacity = capacity_bytes
        self.codec_args = (compression, level)
        Codec(*self.codec_args)  # a bad compression name fails here, before connecting
        self._local = threading.local()
        self.sizes: dict[int, int] = {}  # block id -> bytes of its value in Redis
        self._used = 0
        # Keys a failed put of a private tier may have written (its replies lost): its own, to overwrite or delete.
        self._orphans: set[bytes] = set()
        self.integrity_errors = 0
        self.missing_blocks = 0
        self.envelope_bytes = _ENVELOPE.size + len(self.key(0))
        self.value_overhead = self.envelope_bytes + HEADER_BYTES
        self.max_value_bytes = self.block_bytes + self.value_overhead  # an fp16 block stored raw
        self.chunk_blocks = max(1, _BATCH_BYTES // self.max_value_bytes)  # values per pipeline
        self.get_window_blocks = max(1, _GET_WINDOW_BYTES // self.max_value_bytes)
        self.url = url
        self.client, self.cluster = connect(url, timeout)

    def key(self, block_id: int) -> bytes:
        return f"{self.namespace}:{block_id:016x}".encode()

    def codec(self) -> Codec:
        if not hasattr(self._local, "codec"):
            self._local.codec = Codec(*self.codec_args)
        return self._local.codec

    # -- protocol ------------------------------------------------------------------------
    def put(self, ids: Sequence[int], blocks: Blocks) -> None:
        """Stores the batch (one SET per block, pipelined); returns once Redis acknowledged all."""
        self.layout.check(blocks)
        check_ids(ids, num_blocks(blocks), self.name)
        if any(not 0 <= i < 1 << 64 for i in ids):
            raise ValueError(f"redis.put: block ids must be in [0, 2**64), got {[i for i in ids if not 0 <= i < 1 << 64][:4]}")
        stored = [i for i in ids if i in self.sizes]
        if stored:
            raise ValueError(f"redis: block ids already stored: {stored[:8]}")
        need = len(ids) * self.max_value_bytes  # compression only shrinks a value
        if self._used + need > self._capacity:
            raise MemoryError(f"redis tier: {need} more bytes exceed the capacity of {self._capacity}")
        blocks = blocks.to("cpu")
        keys = [self.key(i) for i in ids]
        sizes, results = self._set_all(ids, keys, blocks)
        self._record(ids, keys, sizes, results)

    def _set_all(self, ids: Sequence[int], keys: list[bytes], blocks: Blocks) -> tuple[list[int], list]:
        """(value sizes, SET answers), a pipeline per chunk: SET NX, but a plain SET over this tier's own
        leftovers. A failure leaves every key that may have been written among the leftovers."""
        own = self._orphans.intersection(keys)
        sizes: list[int] = []
        results: list = []
        sent = 0
        try:
            for start in range(0, len(ids), self.chunk_blocks):
                chunk = slice(start, start + self.chunk_blocks)
                values = self._encode_chunk(ids[chunk], keys[chunk], blocks, start)
                sizes += map(len, values)
                sent = start + len(values)
                results += self._run(keys[chunk], lambda pipe, k, v: pipe.set(k, v, nx=k not in own), values)
        except BaseException:
            if not self.shared:  # answered True: written; unanswered: maybe written (a lost reply)
                self._orphans.update([k for k, r in zip(keys, results) if r is True] + keys[len(results):sent])
            raise
        return sizes, results

    def _encode_chunk(self, ids: Sequence[int], keys: list[bytes], blocks: Blocks, first_row: int) -> list[memoryview]:
        """The values of one pipeline, each a view into this thread's reused buffer (valid until
        the next chunk): one copy into warm memory instead of a fresh allocation per value."""
        codec, views, at = self.codec(), [], 0
        arena = getattr(self._local, "arena", None)
        if arena is None:
            arena = self._local.arena = memoryview(bytearray(self.chunk_blocks * self.max_value_bytes))
        for row, (block_id, key) in enumerate(zip(ids, keys), first_row):
            start = at
            for part in codec.encode_parts(self.layout, blocks, row, _ENVELOPE.pack(_MAGIC, block_id, len(key)) + key):
                arena[at: at + len(part)] = part
                at += len(part)
            views.append(arena[start:at])
        return views

    def _record(self, ids: Sequence[int], keys: list[bytes], sizes: list[int], results: list) -> None:
        """Index what the SETs stored; undo the batch if any failed (nothing half-written stays)."""
        failed = [r for r in results if isinstance(r, Exception)]
        taken = [k for k, r in zip(keys, results) if r is None]  # SET NX found the key there (not a leftover of this tier)
        if failed or (taken and not self.shared):
            self._undo([k for k, r in zip(keys, results) if r is True])
            if failed:  # _run lets only OOM answers to a SET through
                raise MemoryError(f"redis at {self.url} is out of memory (maxmemory, noeviction): {failed[0]}")
            raise ValueError(f"redis: {len(taken)} keys already exist in namespace {self.namespace!r} "
                             f"(another store writes there?): {taken[:4]}")
        adopted = dict(zip(taken, self._run(taken, lambda pipe, k, _: pipe.strlen(k)))) if taken else {}
        self._orphans.difference_update(keys)
        for block_id, key, size in zip(ids, keys, sizes):
            self.sizes[block_id] = adopted.get(key, size)
            self._used += self.sizes[block_id]

    def _undo(self, written: list[bytes]) -> None:
        """Delete what a refused batch wrote; until Redis confirms, those keys are leftovers."""
        if not written:
            return
        if not self.shared:
            self._orphans.update(written)
        self._run(written, lambda pipe, k, _: pipe.delete(k))
        self._orphans.difference_update(written)

    def get(self, ids: Sequence[int]) -> Blocks:
        """Verified blocks, in order; a batch mixing fp16 and int8 blocks comes back fp16. Raw
        values are received straight into the batch (tiers/redis_batch.py)."""
        unknown = [i for i in ids if i not in self.sizes]
        if unknown:
            raise KeyError(f"redis: blocks not stored: {unknown[:8]}")
        keys = [self.key(i) for i in ids]
        try:
            with closing(get_replies(self.client, keys, self.get_window_blocks)) as replies:  # failed: conns back
                return self._receive(ids, keys, replies)
        except SlotsMoved:  # the cluster resharded: redis-py's pipeline follows the redirects
            return self._receive(ids, keys, pipelined_gets(self.client, self.url, keys, self.chunk_blocks))

    def _receive(self, ids: Sequence[int], keys: list[bytes], replies: Iterator) -> Blocks:
        """Fills a batch from (row, length / None / error answer, reader) replies."""
        batch = InPlaceBatch(self.codec(), self.layout, len(ids), self.envelope_bytes)
        gone: list[int] = []
        try:
            for row, length, reader in replies:
                block_id, key = ids[row], keys[row]
                what = f"redis block {block_id} ({key.decode()})"
                if length is None:
                    gone.append(block_id)
                elif isinstance(length, Exception):  # e.g. WRONGTYPE: something else lives under the key
                    if not about_key_or_memory(length):
                        raise ConnectionError(f"redis tier: {self.url} is not serving ({length})")
                    raise IntegrityError(f"{what}: {length}")
                else:
                    batch.receive(row, length, reader.read_into,
                                  lambda value: self._check_envelope(block_id, key, value, what), what)
        except IntegrityError:
            self.integrity_errors += 1
            raise
        if gone:
            self.missing_blocks += len(gone)
            error = BlockMissingError(f"redis: {len(gone)} blocks are gone from {self.namespace!r} "
                                      f"(evicted by Redis's maxmemory policy?): {gone[:8]}")
            error.ids = gone
            raise error
        return batch.result()

    def attach(self, ids: Sequence[int]) -> None:
        """Adopt blocks another process stored under this namespace; all or none."""
        check_ids(ids, len(ids), self.name)
        known = [i for i in ids if i in self.sizes]
        if known:
            raise ValueError(f"redis: block ids already stored: {known[:8]}")
        lengths = self._run([self.key(i) for i in ids], lambda pipe, k, _: pipe.strlen(k))
        absent = [i for i, n in zip(ids, lengths) if not isinstance(n, int) or not n]
        if absent:
            raise BlockMissingError(f"redis: no blocks {absent[:8]} in namespace {self.namespace!r}")
        for block_id, n in zip(ids, lengths):
            self.sizes[block_id] = n
            self._used += n

    def delete(self, ids: Sequence[int]) -> None:
        """Private tiers delete the keys (an evicted key is no error); shared ones only forget them."""
        unknown = [i for i in ids if i not in self.sizes]
        if unknown:
            raise KeyError(f"redis: blocks not stored: {unknown[:8]}")
        if not self.shared:
            self._run([self.key(i) for i in ids], lambda pipe, k, _: pipe.delete(k))
        for block_id in ids:
            self._used -= self.sizes.pop(block_id)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.sizes

    @property
    def num_blocks(self) -> int:
        return len(self.sizes)

    def check_integrity(self) -> None:
        """Byte count matches the index; every indexed key still in Redis has the recorded size
        (a key Redis evicted is allowed: `get` reports it)."""
        if sum(self.sizes.values()) != self._used:
            raise AssertionError("redis tier: used bytes disagree with the block index")
        ids = list(self.sizes)
        lengths = self._run([self.key(i) for i in ids], lambda pipe, k, _: pipe.strlen(k))
        changed = [i for i, n in zip(ids, lengths) if n and n != self.sizes[i]]
        if changed:
            raise AssertionError(f"redis tier: values of blocks {changed[:8]} changed size behind this tier")
        if any(self.key(i) in self._orphans for i in ids):
            raise AssertionError("redis tier: a recorded block's key is also listed as a leftover")

    def close(self) -> None:
        """A private tier deletes its keys (no table points at them once closed); a shared one leaves them."""
        try:
            if not self.shared:
                keys = [self.key(i) for i in self.sizes] + list(self._orphans)
                self._run(keys, lambda pipe, k, _: pipe.delete(k))
                self.sizes.clear()
                self._orphans.clear()
                self._used = 0
        except ConnectionError as exc:
            warnings.warn(f"redis tier: could not delete {len(self.sizes)} blocks of {self.namespace!r}: {exc}")
        finally:
            self.client.close()

    # -- values and pipelines ------------------------------------------------------------
    @staticmethod
    def _check_envelope(block_id: int, key: bytes, value: memoryview, what: str) -> None:
        """The value names this block and key (the codec's checksum then covers the envelope)."""
        end = _ENVELOPE.size + len(key)
        if len(value) < end:
            raise IntegrityError(f"{what}: value of {len(value)} bytes is shorter than its envelope")
        magic, stored_id, key_len = _ENVELOPE.unpack_from(value)
        if magic != _MAGIC or stored_id != block_id or key_len != len(key) or value[_ENVELOPE.size:end] != key:
            raise IntegrityError(f"{what}: the value names another block or key")

    def _run(self, keys: list[bytes], command: Callable, values: Sequence | None = None) -> list:
        """command(pipe, key, value) per key, `chunk_blocks` keys per pipeline (redis_wire.pipelined)."""
        return pipelined(self.client, self.url, keys, command, values, self.chunk_blocks)
