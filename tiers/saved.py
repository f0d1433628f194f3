"""Saved tier: blocks of opened saved contexts, read where the save put them, never copied; and
the two key-value stores saved contexts live in.

Read-only. `adopt` maps block ids onto stored values (codec format: header, payload,
checksum) under keys the saver chose; `fetch_as_stored` reads and verifies them where they lie in the
values store (its `view`: LMDB's mapped pages) into one batch per format (tiers/stored.py); `delete`
forgets the mapping and leaves the saved value where it is.
Nothing is ever put here: blocks leave (promoted to a GPU tier when selected) and never come back.

Values stores (one protocol: put, put_new, get, view, exists, delete, keys, delete_prefix, sync, commit):
    LmdbValues   the cold ssd tier's LMDB environment (keys outside its block prefix); `view` hands out
                 the values where they lie in the map, no copy
    RedisValues  the Redis (or cluster) the cold redis tier talks to, under PREFIX: any process with
                 the same redis_url sees the same saved contexts; `put_new` is SET NX (a content-keyed
                 value is stored once, whoever writes it first); `commit` is one SET, so a manifest is
                 there whole or not at all. Durable on restart only as the server's appendfsync allows.
"""

from __future__ import annotations

import threading
from functools import partial
from typing import Callable, Iterator, Sequence, TypeVar

import lmdb
import redis
import torch

from tiers.codec import Codec
from tiers.errors import BlockMissingError
from tiers.layout import BlockLayout, Blocks
from tiers.stored import StoredBlocks, decode_tier_values

T = TypeVar("T")


class SavedTier:
    name = "saved"

    def __init__(self, layout: BlockLayout, source: LmdbValues | RedisValues | None) -> None:
        self.layout = layout
        self.block_bytes = layout.fp16_bytes
        self.source = source  # None: the cold tier holds no saved contexts (nothing is ever adopted)
        self.key_of: dict[int, bytes] = {}  # block id -> key of its saved value
        self.integrity_errors = 0
        self._local = threading.local()

    def serve_from(self, source: LmdbValues | RedisValues) -> None:
        """Read adopted values from `source` (the saved contexts' values store)."""
        self.source = source

    def adopt(self, ids: Sequence[int], keys: Sequence[bytes]) -> None:
        if self.source is None:
            raise ValueError("saved tier: this store's cold tier holds no saved contexts")
        clash = [i for i in ids if i in self.key_of]
        if clash or len(ids) != len(keys):
            raise ValueError(f"saved tier: {len(ids)} ids for {len(keys)} keys, or ids already adopted: {clash[:8]}")
        self.key_of.update(zip(ids, keys))

    def reads_under(self, prefix: bytes) -> bool:
        """Whether an adopted block's saved value lies under `prefix` (a save's data: not to be deleted)."""
        return any(key.startswith(prefix) for key in self.key_of.values())

    def values(self, ids: Sequence[int]) -> list[bytes | None]:
        """The saved values of adopted blocks as they are stored (None: gone)."""
        return self.source.get([self.key_of[i] for i in ids])

    # -- protocol ------------------------------------------------------------------------
    def put(self, ids: Sequence[int], blocks: Blocks) -> None:
        raise MemoryError("the saved tier is read-only")

    def get(self, ids: Sequence[int]) -> Blocks:
        """Verified blocks, in order; a batch mixing fp16 and int8 blocks comes back fp16 (unlike fetch_as_stored)."""
        return self.fetch_as_stored(ids, "cpu").one_format()

    def fetch_as_stored(self, ids: Sequence[int], device: torch.device | str) -> StoredBlocks:
        """The blocks on `device`, each in the format it was saved in (fp16 or int8), verified where they lie
        (LMDB: in the mapped pages, one read transaction) and copied once into one batch per format."""
        if not hasattr(self._local, "codec"):
            self._local.codec = Codec()  # decode reads the compression from each value's header
        return self.source.view([self.key_of[i] for i in ids], partial(self._decode, ids, device))

    def _decode(self, ids: Sequence[int], device: torch.device | str, values: list) -> StoredBlocks:
        return decode_tier_values(self, self._local.codec, ids, values, "saved", device, lambda gone: BlockMissingError(
            f"saved tier: the saved values of blocks {gone} are gone (the context was deleted or replaced after "
            "it was opened)"))

    def fetch(self, ids: Sequence[int], device: torch.device) -> Blocks:
        return self.fetch_as_stored(ids, device).one_format()

    def delete(self, ids: Sequence[int]) -> None:
        missing = [i for i in ids if i not in self.key_of]
        if missing:
            raise KeyError(f"saved: blocks not adopted: {missing[:8]}")
        for i in ids:
            del self.key_of[i]

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.key_of

    def can_put(self, n: int) -> bool:
        return n == 0

    def free_blocks(self) -> int:
        return 0

    @property
    def num_blocks(self) -> int:
        return len(self.key_of)

    @property
    def used_bytes(self) -> int:
        return 0  # the values belong to the saved contexts, not to this store

    @property
    def capacity_bytes(self) -> int:
        return 0

    def check_integrity(self) -> None:
        if self.key_of and None in self.source.get(list(self.key_of.values())):
            raise AssertionError("saved tier: an adopted block's saved value is gone")

    def close(self) -> None:
        self.key_of.clear()


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
