"""Saved tier: blocks of opened saved contexts, read where the save put them, never copied (from the
values stores of tiers/saved_values.py).

Read-only. `adopt` maps block ids onto saved values under keys the saver chose; `fetch_as_stored` reads
them where they lie in the values store (its `view`: LMDB's mapped pages), checks that each names the key
it was read under and verifies it into one batch per format (tiers/stored.py); `delete` forgets the
mapping and leaves the saved value where it is.
Nothing is ever put here: blocks leave (promoted to a GPU tier when selected) and never come back.

A saved block value is `seal(key, value)`: b"KVSV", the key's length (u16, big endian), the key, then
the codec value (tiers/codec.py: header, payload, xxh3 checksum). The reader knows the key it asks for,
so the envelope is compared byte for byte rather than checksummed: a value read under another key (a
damaged LMDB key, a value SET under another block's key) is refused, and a save can re-key a stored
value without decompressing it to recompute a checksum.
"""

from __future__ import annotations

import threading
from functools import partial
from typing import Sequence

import torch

from tiers.codec import Codec
from tiers.errors import BlockMissingError, IntegrityError
from tiers.layout import FORMAT_CODES, BlockLayout, Blocks
from tiers.saved_values import LmdbValues, RedisValues
from tiers.stored import StoredBlocks, decode_tier_values

_SEAL = b"KVSV"
_FORMAT_AT = 6  # the format byte of a codec value's header (after magic and layout version): FORMAT_CODES


def seal(key: bytes, value: bytes | memoryview) -> bytes:
    """A codec value as saved under `key`: the envelope naming the key, then the value."""
    return _SEAL + len(key).to_bytes(2, "big") + key + value


def unseal(key: bytes, value: bytes | memoryview, what: str) -> memoryview:
    """The codec value inside a saved value read under `key` (a view, no copy); IntegrityError unless its
    envelope names `key`."""
    head = _SEAL + len(key).to_bytes(2, "big") + key
    view = memoryview(value)
    if view[:len(head)] != head:
        raise IntegrityError(f"{what}: the saved value does not name its key (stored under another key, or damaged)")
    return view[len(head):]


def value_format(value: bytes | memoryview, what: str) -> int:
    """The format code (tiers/layout.py FORMAT_CODES) a codec value's header names; IntegrityError for anything else."""
    fmt = value[_FORMAT_AT] if len(value) > _FORMAT_AT else -1
    if fmt not in FORMAT_CODES.values():
        raise IntegrityError(f"{what}: not a block value (format byte {fmt})")
    return fmt


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

    def read_ahead(self, ids: Sequence[int]) -> None:
        """Start reading the saved values of adopted blocks `ids` (a load's next batch) from disk, not waiting."""
        self.source.read_ahead([self.key_of[i] for i in ids])

    def key(self, block_id: int) -> bytes | None:
        """The key of an adopted block's saved value (None: not adopted)."""
        return self.key_of.get(block_id)

    def values(self, ids: Sequence[int]) -> list[bytes | None]:
        """The codec values of adopted blocks, each checked to name its key (None: gone)."""
        keys = [self.key_of[i] for i in ids]
        got = self.source.get(keys)
        return [None if v is None else bytes(self._unseal(i, k, v)) for i, k, v in zip(ids, keys, got)]

    def _unseal(self, block_id: int, key: bytes, value: bytes | memoryview) -> memoryview:
        try:
            return unseal(key, value, f"saved block {block_id}")
        except IntegrityError:
            self.integrity_errors += 1
            raise

    # -- protocol ------------------------------------------------------------------------
    def put(self, ids: Sequence[int], blocks: Blocks) -> None:
        raise MemoryError("the saved tier is read-only")

    def get(self, ids: Sequence[int]) -> Blocks:
        """Verified blocks, in order; a batch mixing formats comes back fp16 (unlike fetch_as_stored)."""
        return self.fetch_as_stored(ids, "cpu").one_format()

    def fetch_as_stored(self, ids: Sequence[int], device: torch.device | str) -> StoredBlocks:
        """The blocks on `device`, each in the format it was saved in (fp16 or quantized), verified where they lie
        (LMDB: in the mapped pages, one read transaction) and copied once into one batch per format."""
        return self.read_as_stored(ids, [self.key_of[i] for i in ids], device)

    def read_as_stored(self, ids: Sequence[int], keys: Sequence[bytes], device: torch.device | str) -> StoredBlocks:
        """fetch_as_stored of blocks whose keys the caller looked up (`key`): what a thread reading beside the
        decode path calls (it reads the values store, never the mapping the decode thread edits)."""
        if not hasattr(self._local, "codec"):
            self._local.codec = Codec()  # decode reads the compression from each value's header
        return self.source.view(list(keys), partial(self._decode, ids, keys, device))

    def _decode(self, ids: Sequence[int], keys: Sequence[bytes], device: torch.device | str,
                values: list) -> StoredBlocks:
        values = [None if v is None else self._unseal(i, k, v) for i, k, v in zip(ids, keys, values)]
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
