"""The block values a save writes, a batch at a time, and the keys it writes them under.

A full block of known token ids (a save with Config.model_id) goes under its content key, one per format
(ctx/block/<format><layer><chain hash>), shared by every save naming it, in LMDB as in Redis: a block whose
key is already stored is not written again, and one the saved tier reads from its content key (an opened
context) is not even read. Any other block goes under the save's own keys. Values come from whichever tier
holds each block: the saved tier's and an ssd cold tier's as they are (resealed under their new key), the
others gathered to the host in one batch per tier and encoded by whole-batch copies (tiers/sealed_rows.py).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from kvstore.blocks.table import LayerTable
from kvstore.blocks.tierset import COLD_TIER, SAVED_TIER, TierSet
from kvstore.contexts.saved_format import BLOCK, content_key
from tiers.errors import BlockMissingError
from tiers.keys import block_key
from tiers.saved import seal, value_format
from tiers.saved_values import Item, LmdbValues, RedisValues
from tiers.sealed_rows import format_code, sealed_rows
from tiers.ssd import SsdTier

BATCH_BYTES = 64 << 20  # block bytes per write batch (one LMDB transaction, or pipelines of Redis SETs)
KeyOf = Callable[[int, int], tuple[bytes, bool]]  # (position, format) -> (key, whether it is a content key)


class SaveBlocks:
    """Builds the write batches of a save's blocks from `tiers` into `values`; counts what it wrote."""

    def __init__(self, values: LmdbValues | RedisValues, tiers: TierSet) -> None:
        self.values, self.tiers = values, tiers
        self.codec = tuple(getattr(tiers.cold, "codec_args", ("zstd", 1)))
        self.batch_blocks = max(1, BATCH_BYTES // tiers.layout.fp16_bytes)
        self._pool: ThreadPoolExecutor | None = None  # zstd of fp16 blocks, where the codec compresses
        self.counts = {"blocks_written": 0, "bytes_written": 0, "blocks_shared": 0}  # since the last reset

    def items(self, layer: int, table: LayerTable, batch: list[int], chain: list[bytes], own: list[bytes],
              formats: list[int]) -> list[Item]:
        """(key, value, only if new) of the blocks at indices `batch` of the layer's table; the first len(chain)
        blocks are content-keyed (their formats recorded in `formats`), the others go under `own` (from index
        len(chain)). BlockMissingError if a block the saved tier reads from its content key is gone."""
        keyed, prefix = len(chain), block_key(layer, b"")
        reused = {i: k for i in batch if i < keyed and (k := self.tiers.saved.key(table.block_ids[i])) is not None
                  and k.startswith(BLOCK) and k[len(BLOCK) + 1:] == prefix + chain[i]}
        if reused:
            gone = [i for i, held in zip(reused, self.values.exists(list(reused.values()))) if not held]
            if gone:
                raise BlockMissingError(f"saved: layer {layer}'s blocks {gone[:8]} to save are gone from their save")
            for i, key in reused.items():
                formats[i] = key[len(BLOCK)]
        todo = [i for i in batch if i not in reused]

        def key_of(pos: int, fmt: int) -> tuple[bytes, bool]:
            i = todo[pos]
            return (content_key(layer, fmt, chain[i]), True) if i < keyed else (own[i - keyed], False)

        out = []
        for i, (key, value, shared) in zip(todo, self.stored_values([table.block_ids[i] for i in todo], key_of)):
            if shared:
                formats[i] = key[len(BLOCK)]
            if value is not None:
                out.append((key, value, shared))
        self.counts["blocks_shared"] += len(batch) - len(out)
        self.counts["blocks_written"] += len(out)
        self.counts["bytes_written"] += sum(len(v) for _, v, _ in out)
        return out

    def stored_values(self, ids: Sequence[int], key_of: KeyOf) -> list[tuple[bytes, bytes | memoryview | None, bool]]:
        """(key, sealed value, content-keyed) of each block in `ids`, in order, each in its tier's format (fp16 or
        quantized): the value None where a content key is already stored (nothing to write)."""
        out: dict[int, tuple[bytes, bytes | memoryview | None, bool]] = {}
        position = {block_id: pos for pos, block_id in enumerate(ids)}
        for tier, group in self.tiers.blocks.by_tier(ids).items():
            rows = [position[i] for i in group]
            if tier == SAVED_TIER or (tier == COLD_TIER and isinstance(self.tiers.cold, SsdTier)):
                got = self.tiers.saved.values(group) if tier == SAVED_TIER else \
                    self.tiers.cold.get_values([self.tiers.cold.key(i) for i in group])
                if any(v is None for v in got):
                    raise BlockMissingError(f"{self.tiers.stack[tier].name}: a block to save is gone")
                keys = [key_of(pos, value_format(v, f"block {i} to save")) for pos, i, v in zip(rows, group, got)]
                new = self._new(keys)
                values = [seal(k, v) if fresh else None for (k, _), v, fresh in zip(keys, got, new)]
            else:
                blocks = self.tiers.stack[tier].get(group).to("cpu")
                fmt = format_code(self.tiers.layout, blocks)
                keys = [key_of(pos, fmt) for pos in rows]
                new = self._new(keys)
                fresh = [r for r, is_new in enumerate(new) if is_new]
                sealed = iter(sealed_rows(self.codec, self.tiers.layout, blocks, fresh,
                                          [seal(keys[r][0], b"") for r in fresh], self._threads()))
                values = [next(sealed) if is_new else None for is_new in new]
            out.update((pos, (k, v, shared)) for pos, (k, shared), v in zip(rows, keys, values))
        return [out[pos] for pos in range(len(ids))]

    def _new(self, keys: list[tuple[bytes, bool]]) -> list[bool]:
        """Whether each key is to be written: own keys always, content keys unless already stored."""
        shared = [k for k, is_shared in keys if is_shared]
        held = iter(self.values.exists(shared) if shared else [])
        return [not (is_shared and next(held)) for _, is_shared in keys]

    def _threads(self) -> ThreadPoolExecutor | None:
        if self.codec[0] == "none":
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="kvtier-save-zstd")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
