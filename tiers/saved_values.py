"""The two key-value stores saved contexts live in (kvstore/contexts/saving.py writes them, tiers/saved.py and
kvstore/contexts/opening.py read them).

Values stores (one protocol: put, put_new, write_all, get, view, exists, delete, keys, delete_prefix, sync,
commit):
    LmdbValues   the cold ssd tier's LMDB environment (keys outside its block prefix); `view` hands out
                 the values where they lie in the map, no copy; `write_all` commits batches from a writer
                 thread while the caller builds the next, and a flusher thread writes committed pages back
                 meanwhile, so that the disk never waits for the caller and the final sync finds little left
    RedisValues  the Redis (or cluster) the cold redis tier talks to, under PREFIX: any process with
                 the same redis_url sees the same saved contexts; `put_new` is SET NX (a content-keyed
                 value is stored once, whoever writes it first); `commit` is one SET, so a manifest is
                 there whole or not at all. Durable on restart only as the server's appendfsync allows.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import queue
import threading
from typing import Callable, Iterable, Sequence, TypeVar

import lmdb
import numpy as np
import redis

T = TypeVar("T")
Item = tuple[bytes, "bytes | memoryview", bool]  # key, value, only if the key is new (content-keyed blocks)
_QUEUED = 2  # batches built ahead of the writer (each ~64 MiB: bounded host memory)
_READ_AHEAD_KEYS = 64  # a view of this many values or more is read ahead as one span where it lies together
_MADV_WILLNEED = 3  # Linux madvise advice: read these pages in now (queued, not waited for)
_READ_AHEAD_STEP = 128 << 10  # bytes per request: Linux's default readahead size, its cap on one WILLNEED


class LmdbValues:
    """Saved-context values in an LMDB environment (the cold ssd tier's); each call is one transaction."""

    shared = False  # one store per ssd_path: blocks go under content keys only with a Config.model_id

    def __init__(self, env: lmdb.Environment) -> None:
        self.env = env

    def put(self, items: list[tuple[bytes, bytes]]) -> None:
        with self.env.begin(write=True) as txn:
            for key, value in items:
                txn.put(key, value)

    def put_new(self, items: list[tuple[bytes, bytes]]) -> None:
        with self.env.begin(write=True) as txn:
            for key, value in items:
                txn.put(key, value, overwrite=False)

    def write_all(self, batches: Iterable[list[Item]]) -> None:
        """Every batch, one transaction each, in order; returns once all are committed (not synced: `sync`).
        The batches are committed by a writer thread while the iterator builds the next (at most _QUEUED
        ahead), and a flusher thread asks the kernel to write committed pages back (fdatasync) as they come,
        so the disk is busy while the caller works. Flushing early only makes pages durable sooner: LMDB
        still syncs a commit's pages before its meta page names them. An error of either side is raised
        here once the writer stopped; batches committed before it stay (the caller deletes them)."""
        done = threading.Event()
        fd = os.open(os.path.join(self.env.path(), "data.mdb"), os.O_RDONLY)
        flusher = threading.Thread(target=_flush_until, args=(fd, done), name="kvtier-saved-flush", daemon=True)
        flusher.start()
        try:
            _write_behind(batches, self._commit)
        finally:
            done.set()
            flusher.join()
            os.close(fd)

    def _commit(self, batch: list[Item]) -> None:
        with self.env.begin(write=True) as txn:
            for key, value, only_new in batch:
                txn.put(key, value, overwrite=not only_new)

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        with self.env.begin() as txn:
            return [txn.get(k) for k in keys]

    def view(self, keys: list[bytes], use: Callable[[list[memoryview | None]], T]) -> T:
        """use(values of `keys`), the values zero-copy views of the mapped pages, valid only during the call.
        A batch whose values lie together in the file (a save's blocks, read in key order either way) is read
        ahead in one request first (_read_ahead)."""
        with self.env.begin(buffers=True) as txn:
            if len(keys) >= _READ_AHEAD_KEYS:
                _read_ahead(txn, keys)
            return use([txn.get(k) for k in keys])

    def read_ahead(self, keys: list[bytes]) -> None:
        """Start reading the values of `keys` from disk without waiting for them (see _read_ahead): a caller
        names the next batch before it works on this one."""
        with self.env.begin(buffers=True) as txn:
            _read_ahead(txn, keys)

    def exists(self, keys: list[bytes]) -> list[bool]:
        return [v is not None for v in self.get(keys)]

    def delete(self, keys: list[bytes]) -> None:
        with self.env.begin(write=True) as txn:
            for key in keys:
                txn.delete(key)

    def keys(self, prefix: bytes) -> list[bytes]:
        """Keys under `prefix`; their values are not read (a key scan over saved blocks touches no block)."""
        with self.env.begin() as txn:
            cursor = txn.cursor()
            if not cursor.set_range(prefix):
                return []
            out = []
            for key in cursor.iternext(keys=True, values=False):
                if not key.startswith(prefix):
                    break
                out.append(key)
            return out

    def delete_prefix(self, prefix: bytes) -> None:
        while True:  # bounded transactions: a huge save is deleted in steps
            with self.env.begin(write=True) as txn:
                cursor, n = txn.cursor(), 0
                if not cursor.set_range(prefix):
                    return
                while bytes(cursor.key()[: len(prefix)]) == prefix and n < 1024:
                    cursor.delete()  # moves to the next key
                    n += 1
                if n == 0:
                    return

    def sync(self) -> None:
        self.env.sync(True)

    def commit(self, key: bytes, value: bytes, done: bytes, also: Sequence[tuple[bytes, bytes]] = ()) -> bytes | None:
        """Put `also` and `key` (replacing; returns the old value) and delete `done`, in one transaction."""
        with self.env.begin(write=True) as txn:
            for k, v in also:
                txn.put(k, v)
            old = txn.get(key)
            txn.put(key, value)
            txn.delete(done)
        return old

    def pop(self, key: bytes) -> bytes | None:
        """Delete `key` and return its value (None if absent), in one transaction."""
        with self.env.begin(write=True) as txn:
            return txn.pop(key)


def _write_behind(batches: Iterable[list[Item]], commit: Callable[[list[Item]], None]) -> None:
    """commit(batch) for every batch on a writer thread while `batches` yields the next; the first error of
    either side is raised once the writer has stopped."""
    pending: queue.Queue = queue.Queue(maxsize=_QUEUED)
    failed: list[BaseException] = []

    def write() -> None:
        while (batch := pending.get()) is not None:
            if not failed:
                try:
                    commit(batch)
                except BaseException as exc:  # noqa: BLE001 -- raised by the caller's thread below
                    failed.append(exc)

    writer = threading.Thread(target=write, name="kvtier-saved-write", daemon=True)
    writer.start()
    try:
        for batch in batches:
            if failed:
                break
            pending.put(batch)
    finally:
        pending.put(None)
        writer.join()
    if failed:
        raise failed[0]


def _read_ahead(txn: lmdb.Transaction, keys: list[bytes]) -> None:
    """Ask the kernel to read the span of the map between the first and the last of `keys`' values when that
    span is at most about twice as large as the values (a save writes a layer's blocks one after another in the file), so
    that the values arrive in large reads. The ssd tier maps LMDB without readahead (random block reads), so
    a value touched page by page is read 4 KiB at a time: ~0.05 GB/s where the disk reads 1.3 GB/s."""
    ends = [txn.get(keys[0]), txn.get(keys[-1])] if keys else [None]  # py-lmdb touches these two values' pages
    if None in ends:
        return
    starts = [np.frombuffer(v, dtype=np.uint8).ctypes.data for v in ends]
    lo, hi = min(starts), max(a + len(v) for a, v in zip(starts, ends))
    if hi - lo > 2 * len(keys) * max(len(v) for v in ends) + (1 << 20):
        return  # scattered values: reading the span would read more than them
    lo -= lo % mmap.PAGESIZE
    for start in range(lo, hi, _READ_AHEAD_STEP):  # the kernel reads at most its readahead size per request
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(min(_READ_AHEAD_STEP, hi - start)), _MADV_WILLNEED)


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _flush_until(fd: int, done: threading.Event) -> None:
    """fdatasync `fd` until `done`: committed pages go to disk while the next batch is built and written."""
    while not done.wait(0.02):
        try:
            os.fdatasync(fd)
        except OSError:
            return  # the writer's own commit reports a failing disk


class RedisValues:
    """Saved-context values in Redis under PREFIX (shared by every store on that server or cluster)."""

    PREFIX = b"kvtier-saved:"
    shared = True  # every store on the server reads its content-keyed blocks: saving needs a Config.model_id
    _BATCH_BYTES = 64 << 20  # values per pipeline (both ways)

    def __init__(self, client: redis.Redis | redis.RedisCluster) -> None:
        self.client = client

    def _run(self, keys: list[bytes], command: Callable, sizes: Sequence[int] | None = None) -> list:
        results, pipe, pending = [], self.client.pipeline(transaction=False), 0
        for i, key in enumerate(keys):
            command(pipe, self.PREFIX + key, i)
            pending += (sizes[i] if sizes else 1 << 16) + 1
            if pending >= self._BATCH_BYTES or i == len(keys) - 1:
                results += pipe.execute()
                pipe, pending = self.client.pipeline(transaction=False), 0
        return results

    def put(self, items: list[tuple[bytes, bytes]]) -> None:
        self._run([k for k, _ in items], lambda pipe, k, i: pipe.set(k, items[i][1]), [len(v) for _, v in items])

    def put_new(self, items: list[tuple[bytes, bytes]]) -> None:
        self._run([k for k, _ in items], lambda pipe, k, i: pipe.set(k, items[i][1], nx=True),
                  [len(v) for _, v in items])

    def write_all(self, batches: Iterable[list[Item]]) -> None:
        """Every batch (SET, or SET NX for an item only if new), pipelined from a writer thread while the
        iterator builds the next; returns once every command was acknowledged."""
        _write_behind(batches, lambda batch: self._run(
            [k for k, _, _ in batch], lambda pipe, k, i: pipe.set(k, batch[i][1], nx=batch[i][2]),
            [len(v) for _, v, _ in batch]))

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        return self._run(keys, lambda pipe, k, _: pipe.get(k))

    def view(self, keys: list[bytes], use: Callable[[list[bytes | None]], T]) -> T:
        """use(values of `keys`) (LmdbValues.view's protocol; here the values are the bytes received)."""
        return use(self.get(keys))

    def read_ahead(self, keys: list[bytes]) -> None:
        """Nothing: a Redis read is one pipelined round trip per batch."""

    def exists(self, keys: list[bytes]) -> list[bool]:
        return [bool(n) for n in self._run(keys, lambda pipe, k, _: pipe.exists(k), [0] * len(keys))]

    def delete(self, keys: list[bytes]) -> None:
        self._run(keys, lambda pipe, k, _: pipe.delete(k), [0] * len(keys))

    def keys(self, prefix: bytes) -> list[bytes]:
        """Keys under `prefix` (ASCII without glob characters), on every master of a cluster."""
        return [k[len(self.PREFIX):] for k in self.client.scan_iter(match=self.PREFIX + prefix + b"*", count=1000)]

    def delete_prefix(self, prefix: bytes) -> None:
        keys = self.keys(prefix)
        if keys:
            self.delete(keys)

    def sync(self) -> None:
        """Every write above was acknowledged; persistence is the server's (appendfsync)."""

    def commit(self, key: bytes, value: bytes, done: bytes, also: Sequence[tuple[bytes, bytes]] = ()) -> bytes | None:
        """SET `also`, then `key` (one command: whole or absent; returns the old value), then delete `done` as far
        as the server answers: the save is committed once the SET is, and a `done` key left behind is harmless
        (collect_garbage skips a pending key whose save has a manifest)."""
        if also:
            self.put(list(also))
        old = self.client.set(self.PREFIX + key, value, get=True)
        try:
            self.client.delete(self.PREFIX + done)
        except (redis.RedisError, OSError):
            pass
        return old

    def pop(self, key: bytes) -> bytes | None:
        """Delete `key` and return its value (None if absent), in one command (GETDEL)."""
        return self.client.getdel(self.PREFIX + key)
