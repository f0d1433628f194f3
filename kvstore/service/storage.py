"""The sidecar's durable store: (namespace, key) -> tensor value in LMDB, a CPU cache in front.

Durability: every put goes through tiers.ssd.SsdTier's single LMDB writer and returns
only after its transaction committed. With `sync=True` (the default) LMDB fsyncs every
commit, so an acknowledged put survives kill -9 and power loss; the writer folds the
puts that queue up meanwhile into one commit, so the cost is one fsync per group of
concurrent puts (bench_longctx/service_bench.py measures it). `sync=False` skips the
fsync: acknowledged puts still survive kill -9 (they are in the page cache), not an OS
crash.

The CPU tier is a byte-budgeted LRU of stored values. The LMDB writer writes it through
in commit order (tiers.ssd.SsdTier.on_commit), so it never holds a value older than
LMDB's; reads fill it only when no commit ran during their LMDB read.

LMDB keys: b"v/" + namespace + b"/" + key. Namespaces cannot contain "/", so one
namespace's keys are never a prefix scan away from another's. Each value also holds its
key inside its checksummed header (values.py), so a damaged key never serves another's data.

A damaged LMDB file does not stop the service: it starts read-only on the intact values
(damage.py) and says so in stats() and health().
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict

import xxhash

from kvstore.service.damage import PREFIX as _PREFIX
from kvstore.service.damage import open_values
from kvstore.service.metrics import ServiceMetrics
from kvstore.service.values import Value, ValueCodec
from tiers.remote.wire import Descriptor, WireError
from tiers.base import IntegrityError


class NotFound(KeyError):
    """Keys that are not stored; the service answers 404 naming them."""

    def __init__(self, namespace: str, keys: list[str]) -> None:
        super().__init__(f"namespace {namespace!r}: {len(keys)} key(s) not found: {keys[:8]}")
        self.keys = keys


class StorageFull(MemoryError):
    """The ssd budget cannot take a put; the service answers 507 and stores nothing."""


class ValueCache:
    """Byte-budgeted LRU of stored values, written through in LMDB commit order."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.items: OrderedDict[bytes, bytes] = OrderedDict()
        self.bytes = 0
        self.commits = 0  # bumped by every commit; a read fills the cache only if it did not move
        self.lock = threading.Lock()

    def lookup(self, keys: list[bytes]) -> list[bytes | None]:
        with self.lock:
            out = [self.items.get(k) for k in keys]
            for key, value in zip(keys, out):
                if value is not None:
                    self.items.move_to_end(key)
            return out

    def apply(self, changes: list[tuple[bytes, int | None, bytes | None]]) -> None:
        with self.lock:
            self.commits += 1
            for key, _, value in changes:
                self._set(key, value)

    def fill(self, since: int, pairs: list[tuple[bytes, bytes]]) -> None:
        with self.lock:
            if self.commits == since:
                for key, value in pairs:
                    self._set(key, value)

    def discard(self, key: bytes) -> None:
        with self.lock:
            self._set(key, None)

    def _set(self, key: bytes, value: bytes | None) -> None:
        old = self.items.pop(key, None)
        self.bytes -= len(old) if old is not None else 0
        if value is None or len(value) > self.budget:
            return
        self.items[key] = value
        self.bytes += len(value)
        while self.bytes > self.budget:
            _, evicted = self.items.popitem(last=False)
            self.bytes -= len(evicted)


class ServiceStorage:
    """Blocking API over the cache + LMDB; the app calls it from worker threads."""

    def __init__(self, data_dir: str, cpu_bytes: int, ssd_bytes: int, metrics: ServiceMetrics,
                 compression: str = "none", sync: bool = True) -> None:
        self.metrics = metrics
        self.compression = compression
        self.sync = sync
        self.cache = ValueCache(cpu_bytes)
        self.integrity_errors = 0
        self._codec = threading.local()
        ValueCodec(compression)  # validates `compression` before anything is opened
        self.ssd, self.damage = open_values(os.path.join(data_dir, "values.lmdb"), ssd_bytes, sync)
        metrics.degraded.set(int(self.damage.read_only))
        metrics.damage_problems.set(len(self.damage.problems))
        metrics.damaged_values.set(self.damage.damaged_values)
        if self.damage.read_only:
            logging.getLogger(__name__).error("kvtier service: %s is damaged; serving %d intact values read-only: %s",
                                              data_dir, self.damage.found_values, self.damage.problems[:5])
        self._lock = threading.Lock()  # guards namespace totals and the bytes reserved by puts in flight
        self._reserved = 0
        self.namespaces: dict[str, list[int]] = {}  # namespace -> [blocks, bytes]
        for key, size in self.ssd.sizes.items():
            self._count(key, None, size)
        self.ssd.on_commit = self._on_commit

    # -- writes ------------------------------------------------------------------------------
    def put(self, namespace: str, items: list[tuple[str, Descriptor, bytes | memoryview, int | None]]) -> int:
        """Store (key, descriptor, payload, checksum or None) items atomically; returns payload bytes."""
        values = []
        for key, desc, payload, checksum in items:
            actual = xxhash.xxh3_64_intdigest(payload)
            if checksum is not None and checksum != actual:
                raise WireError(f"key {key!r}: body checksum {actual:016x} != x-kvtier-checksum {checksum:016x} "
                                 "(the bytes were damaged on the way)")
            values.append(self.codec().encode(desc, payload, actual, _lmdb_key(namespace, key)))
        need = sum(map(len, values))
        with self._lock:
            free = self.ssd.capacity_bytes - self.ssd.used_bytes - self._reserved
            if need > free:
                raise StorageFull(f"put of {need} stored bytes exceeds the free ssd budget of {max(free, 0)} bytes")
            self._reserved += need
        try:
            self.ssd.put_values([_lmdb_key(namespace, k) for k, *_ in items], values)
        finally:
            with self._lock:
                self._reserved -= need
        return sum(len(p) for _, _, p, _ in items)

    def put_new(self, namespace: str, items: list[tuple[str, Descriptor, bytes | memoryview, int | None]]
                ) -> tuple[int, int]:
        """put() of the items whose keys are not held yet (content-addressed values are stored once);
        returns (values stored, payload bytes stored)."""
        fresh = [item for item in items if _lmdb_key(namespace, item[0]) not in self.ssd.sizes]
        return len(fresh), self.put(namespace, fresh) if fresh else 0

    def delete(self, namespace: str, keys: list[str]) -> int:
        """Delete every key, or none if any is missing."""
        lkeys = [_lmdb_key(namespace, k) for k in keys]
        missing = [k for k, lk in zip(keys, lkeys) if lk not in self.ssd.sizes]
        if missing:
            raise NotFound(namespace, missing)
        self.ssd.delete_keys(lkeys)
        return len(lkeys)

    def drop(self, namespace: str) -> int:
        """Delete every key of a namespace."""
        prefix, deleted = _lmdb_key(namespace, ""), 0
        while keys := self.ssd.scan_keys(prefix, limit=10_000):
            self.ssd.delete_keys(keys)
            deleted += len(keys)
        return deleted

    # -- reads -------------------------------------------------------------------------------
    def get(self, namespace: str, keys: list[str]) -> list[Value]:
        """Verified values of `keys`, in order; NotFound names every missing key."""
        lkeys = [_lmdb_key(namespace, k) for k in keys]
        stored = self.cache.lookup(lkeys)
        misses = [i for i, v in enumerate(stored) if v is None]
        self.metrics.lookups.labels("cpu_hit").inc(len(keys) - len(misses))
        if misses:
            since = self.cache.commits
            for i, value in zip(misses, self.ssd.get_values([lkeys[i] for i in misses])):
                stored[i] = value
            missing = [keys[i] for i in misses if stored[i] is None]
            self.metrics.lookups.labels("ssd_hit").inc(len(misses) - len(missing))
            self.metrics.lookups.labels("miss").inc(len(missing))
            if missing:
                raise NotFound(namespace, missing)
            self.cache.fill(since, [(lkeys[i], stored[i]) for i in misses])
        return [self._decode(namespace, key, lkey, value) for key, lkey, value in zip(keys, lkeys, stored)]

    def _decode(self, namespace: str, key: str, lkey: bytes, value: bytes) -> Value:
        try:
            return self.codec().decode(value, f"namespace {namespace!r} key {key!r}", lkey)
        except IntegrityError:
            self.integrity_errors += 1
            self.metrics.integrity_errors.inc()
            self.cache.discard(lkey)
            raise

    def num_held(self, namespace: str, keys: list[str]) -> int:
        """How many of `keys`, from the first, are stored: the length of the held prefix."""
        for i, key in enumerate(keys):
            if _lmdb_key(namespace, key) not in self.ssd.sizes:
                return i
        return len(keys)

    def keys(self, namespace: str, prefix: str = "", after: str = "", limit: int = 1000) -> tuple[list[str], bool]:
        """Up to `limit` keys starting with `prefix`, sorted, after `after`; and whether more exist."""
        base = _lmdb_key(namespace, "")
        found = self.ssd.scan_keys(base + prefix.encode(), after=base + after.encode() if after else b"",
                                   limit=limit + 1)
        return [k[len(base):].decode() for k in found[:limit]], len(found) > limit

    # -- accounting --------------------------------------------------------------------------
    def codec(self) -> ValueCodec:
        if not hasattr(self._codec, "codec"):
            self._codec.codec = ValueCodec(self.compression)
        return self._codec.codec

    def _on_commit(self, changes: list[tuple[bytes, int | None, bytes | None]]) -> None:
        """Runs on the LMDB writer thread after each commit; it must never raise there."""
        try:
            self.cache.apply(changes)
            with self._lock:
                for key, old, value in changes:
                    self._count(key, old, None if value is None else len(value))
        except Exception:  # a bookkeeping bug must not stop the writer: the commit itself is durable
            logging.getLogger(__name__).exception("kvtier service: commit bookkeeping failed")

    def _count(self, key: bytes, old: int | None, new: int | None) -> None:
        namespace = key[len(_PREFIX):].split(b"/", 1)[0].decode()
        totals = self.namespaces.setdefault(namespace, [0, 0])
        totals[0] += (new is not None) - (old is not None)
        totals[1] += (new or 0) - (old or 0)
        if totals[0] == 0:
            del self.namespaces[namespace]

    def namespace_names(self) -> list[str]:
        with self._lock:
            return sorted(self.namespaces)

    def namespace_stats(self, namespace: str) -> dict:
        with self._lock:
            blocks, nbytes = self.namespaces.get(namespace, (0, 0))
        return {"namespace": namespace, "blocks": blocks, "bytes": nbytes}

    def stats(self) -> dict:
        with self._lock:
            namespaces = len(self.namespaces)
        return {
            "tiers": {
                "cpu": {"blocks": len(self.cache.items), "bytes": self.cache.bytes, "capacity_bytes": self.cache.budget},
                "ssd": {"blocks": self.ssd.num_blocks, "bytes": self.ssd.used_bytes,
                        "capacity_bytes": self.ssd.capacity_bytes},
            },
            "namespaces": namespaces,
            "integrity_errors": self.integrity_errors,
            "durability": "fsync per commit" if self.sync else "no fsync (survives kill -9, not an OS crash)",
            "compression": self.compression,
            "mode": "read-only (damaged file)" if self.damage.read_only else "read-write",
            "damage": self.damage.summary() if self.damage.read_only else None,
        }

    def health(self) -> dict:
        """/healthz: "ok", or "degraded" once damage is known (at startup, or a value that failed its checksum)."""
        if not self.damage.read_only and not self.integrity_errors:
            return {"status": "ok"}
        out: dict = {"status": "degraded", "mode": "read-only" if self.damage.read_only else "read-write",
                     "integrity_errors": self.integrity_errors}
        if self.damage.read_only:
            out["damage"] = self.damage.summary()
        return out

    def close(self) -> None:
        self.ssd.close()


def _lmdb_key(namespace: str, key: str) -> bytes:
    return _PREFIX + namespace.encode() + b"/" + key.encode()
