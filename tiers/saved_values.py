"""The two key-value stores saved contexts live in (kvstore/contexts/saving.py writes them, tiers/saved.py and
kvstore/contexts/opening.py read them).

Values stores (one protocol: put, put_new, get, view, exists, delete, keys, delete_prefix, sync, commit):
    LmdbValues   the cold ssd tier's LMDB environment (keys outside its block prefix); `view` hands out
                 the values where they lie in the map, no copy
    RedisValues  the Redis (or cluster) the cold redis tier talks to, under PREFIX: any process with
                 the same redis_url sees the same saved contexts; `put_new` is SET NX (a content-keyed
                 value is stored once, whoever writes it first); `commit` is one SET, so a manifest is
                 there whole or not at all. Durable on restart only as the server's appendfsync allows.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence, TypeVar

import lmdb
import redis

T = TypeVar("T")


class LmdbValues:
    """Saved-context values in an LMDB environment (the cold ssd tier's); each call is one transaction."""

    content_keyed = False  # a save owns its blocks: deleting it deletes them (no other save points at them)

    def __init__(self, env: lmdb.Environment) -> None:
        self.env = env

    def put(self, items: list[tuple[bytes, bytes]]) -> None:
        with self.env.begin(write=True) as txn:
            for key, value in items:
                txn.put(key, value)

    put_new = put

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        with self.env.begin() as txn:
            return [txn.get(k) for k in keys]

    def view(self, keys: list[bytes], use: Callable[[list[memoryview | None]], T]) -> T:
        """use(values of `keys`), the values zero-copy views of the mapped pages, valid only during the call."""
        with self.env.begin(buffers=True) as txn:
            return use([txn.get(k) for k in keys])

    def exists(self, keys: list[bytes]) -> list[bool]:
        return [v is not None for v in self.get(keys)]

    def delete(self, keys: list[bytes]) -> None:
        with self.env.begin(write=True) as txn:
            for key in keys:
                txn.delete(key)

    def keys(self, prefix: bytes) -> list[bytes]:
        with self.env.begin() as txn:
            return [bytes(k) for k, _ in _lmdb_prefix_items(txn, prefix)]

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

    def commit(self, key: bytes, value: bytes, done: bytes) -> bytes | None:
        """Put `key` (replacing; returns the old value) and delete `done`, in one transaction."""
        with self.env.begin(write=True) as txn:
            old = txn.get(key)
            txn.put(key, value)
            txn.delete(done)
        return old

    def pop(self, key: bytes) -> bytes | None:
        """Delete `key` and return its value (None if absent), in one transaction."""
        with self.env.begin(write=True) as txn:
            return txn.pop(key)


def _lmdb_prefix_items(txn: lmdb.Transaction, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    cursor = txn.cursor()
    if not cursor.set_range(prefix):
        return
    for key, value in cursor:
        if not key.startswith(prefix):
            return
        yield key, value


class RedisValues:
    """Saved-context values in Redis under PREFIX (shared by every store on that server or cluster)."""

    PREFIX = b"kvtier-saved:"
    content_keyed = True  # blocks under content keys, stored once and shared by every save that names them
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

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        return self._run(keys, lambda pipe, k, _: pipe.get(k))

    def view(self, keys: list[bytes], use: Callable[[list[bytes | None]], T]) -> T:
        """use(values of `keys`) (LmdbValues.view's protocol; here the values are the bytes received)."""
        return use(self.get(keys))

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

    def commit(self, key: bytes, value: bytes, done: bytes) -> bytes | None:
        """SET `key` (one command: whole or absent; returns the old value), then delete `done` as far as the
        server answers: the save is committed once the SET is, and a `done` key left behind is harmless
        (collect_garbage skips a pending key whose save has a manifest)."""
        old = self.client.set(self.PREFIX + key, value, get=True)
        try:
            self.client.delete(self.PREFIX + done)
        except (redis.RedisError, OSError):
            pass
        return old

    def pop(self, key: bytes) -> bytes | None:
        """Delete `key` and return its value (None if absent), in one command (GETDEL)."""
        return self.client.getdel(self.PREFIX + key)
