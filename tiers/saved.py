"""Saved tier: blocks of opened saved contexts, read where the save put them, never copied.

Read-only. `adopt` maps block ids onto stored values (codec format: header, payload,
checksum) under keys the saver chose; `get` reads and verifies them through the cold store's
`get_values`; `delete` forgets the mapping and leaves the saved value where it is. Nothing is
ever put here: blocks leave (promoted to a GPU tier when selected) and never come back.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch

from tiers.base import IntegrityError
from tiers.codec import Codec
from tiers.errors import BlockMissingError
from tiers.layout import BlockLayout, Blocks, concat
from tiers.quant import one_format


class SavedTier:
    name = "saved"

    def __init__(self, layout: BlockLayout, get_values: Callable[[list[bytes]], list[bytes | None]] | None) -> None:
        self.layout = layout
        self.block_bytes = layout.fp16_bytes
        self.get_values = get_values  # None: the cold tier holds no saved contexts (nothing is ever adopted)
        self.key_of: dict[int, bytes] = {}  # block id -> key of its saved value
        self.integrity_errors = 0
        self._local = threading.local()

    def adopt(self, ids: Sequence[int], keys: Sequence[bytes]) -> None:
        if self.get_values is None:
            raise ValueError("saved tier: this store's cold tier holds no saved contexts")
        clash = [i for i in ids if i in self.key_of]
        if clash or len(ids) != len(keys):
            raise ValueError(f"saved tier: {len(ids)} ids for {len(keys)} keys, or ids already adopted: {clash[:8]}")
        self.key_of.update(zip(ids, keys))

    # -- protocol ------------------------------------------------------------------------
    def put(self, ids: Sequence[int], blocks: Blocks) -> None:
        raise MemoryError("the saved tier is read-only")

    def get(self, ids: Sequence[int]) -> Blocks:
        if not hasattr(self._local, "codec"):
            self._local.codec = Codec()  # decode reads the compression from each value's header
        values = self.get_values([self.key_of[i] for i in ids])
        missing = [i for i, v in zip(ids, values) if v is None]
        if missing:
            raise BlockMissingError(f"saved tier: the saved values of blocks {missing[:8]} are gone "
                                    "(the context was deleted or replaced after it was opened)")
        try:
            parts = [self._local.codec.decode(self.layout, v, f"saved block {i}") for i, v in zip(ids, values)]
        except IntegrityError:
            self.integrity_errors += 1
            raise
        return concat(one_format(parts)) if parts else self.layout.empty_fp16(0, "cpu")

    def fetch(self, ids: Sequence[int], device: torch.device) -> Blocks:
        return self.get(ids).to(device, non_blocking=True)

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
        if self.key_of and None in self.get_values(list(self.key_of.values())):
            raise AssertionError("saved tier: an adopted block's saved value is gone")

    def close(self) -> None:
        self.key_of.clear()
