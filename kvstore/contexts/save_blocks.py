"""The block values a save writes, a batch at a time, and the keys it writes them under.

A full block of known token ids (a save with Config.model_id) goes under its content key, one per format
(ctx/block/<format><layer><chain hash>), shared by every save naming it, in LMDB as in Redis: a block whose
key is already stored is not written again, and one the saved tier reads from its content key (an opened
context) is not even read. Any other block goes under the save's own keys.

A batch is handled in two halves. `read` takes the blocks out of whichever tier holds each, on the thread that
owns the tiers: the others gathered to the host in one batch per tier (on CUDA queued into pinned memory, an
event marking when it landed), an ssd cold tier's values as they are stored, and for the saved tier only the
keys of its values (they stay where the save put them). `encode` works on what `read` returned, on any
thread: it reads the saved tier's values by key from the values store, checks which content keys are stored
already, and seals the rest under their keys, tensors by whole-batch copies (tiers/sealed_rows.py). A save
runs both in turn; a background save (kvstore/contexts/background_save.py) reads between tokens and encodes on
its writer thread.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvstore.blocks.table import LayerTable
from kvstore.blocks.tierset import COLD_TIER, SAVED_TIER, TierSet
from kvstore.contexts.saved_format import BLOCK, content_key
from tiers.errors import BlockMissingError, IntegrityError
from tiers.keys import block_key
from tiers.block_rows import device_of
from tiers.layout import Blocks
from tiers.saved import seal, unseal, value_format
from tiers.saved_values import Item, LmdbValues, RedisValues
from tiers.sealed_rows import format_code, sealed_rows
from tiers.ssd import SsdTier

BATCH_BYTES = 64 << 20  # block bytes per write batch (one LMDB transaction, or pipelines of Redis SETs)
KeyOf = Callable[[int, int], tuple[bytes, bool]]  # (row, format) -> (key, whether it is a content key)


@dataclass(slots=True)
class Group:
    """Rows of a batch read out of one tier, in one of three forms."""

    rows: list[int]
    blocks: Blocks | None = None  # host copies (fp16 or quantized), landed once `ready` has
    values: list[bytes] | None = None  # codec values as an ssd cold tier stores them
    keys: list[bytes] | None = None  # keys of the saved tier's values, read by `encode`
    ready: torch.cuda.Event | None = None


class SaveBlocks:
    """Reads a save's blocks out of `tiers` and encodes them as write batches for `values`."""

    def __init__(self, values: LmdbValues | RedisValues, tiers: TierSet) -> None:
        self.values, self.tiers = values, tiers
        self.codec = tuple(getattr(tiers.cold, "codec_args", ("zstd", 1)))
        self.batch_blocks = max(1, BATCH_BYTES // tiers.layout.fp16_bytes)
        self._pool: ThreadPoolExecutor | None = None  # zstd of fp16 blocks, where the codec compresses
        self._pool_lock = threading.Lock()  # a save and a background save's writer may start it at once
        self.counts = {"blocks_written": 0, "bytes_written": 0, "blocks_shared": 0}  # since the last reset

    def items(self, layer: int, table: LayerTable, batch: list[int], chain: list[bytes], own: list[bytes],
              formats: list[int]) -> list[Item]:
        """(key, value, only if new) of the blocks at indices `batch` of the layer's table (`encode`)."""
        return self.encode(layer, batch, self.read([table.block_ids[i] for i in batch]), chain, own, formats,
                           self.counts)

    # -- on the thread that owns the tiers --------------------------------------------------
    def read(self, ids: Sequence[int]) -> list[Group]:
        """The blocks `ids` out of whichever tiers hold them, one Group per tier (rows: positions in `ids`)."""
        position = {block_id: pos for pos, block_id in enumerate(ids)}
        return [self.read_from(tier, group, [position[i] for i in group])
                for tier, group in self.tiers.blocks.by_tier(ids).items()]

    def read_from(self, tier: int, ids: Sequence[int], rows: list[int]) -> Group:
        """Blocks `ids` (rows `rows` of a batch) out of `tier`, which holds them (verified where they are read)."""
        if tier == SAVED_TIER:
            return Group(rows, keys=[self.tiers.saved.key(i) for i in ids])
        if tier == COLD_TIER and isinstance(self.tiers.cold, SsdTier):
            values = self.tiers.cold.get_values([self.tiers.cold.key(i) for i in ids])
            if any(v is None for v in values):
                raise BlockMissingError("ssd: a block to save is gone")
            return Group(rows, values=values)
        blocks = self.tiers.stack[tier].get(ids)
        if device_of(blocks).type == "cuda":
            blocks = blocks.to("cpu", non_blocking=True)  # pinned; queued behind the gather
            ready = torch.cuda.Event()
            ready.record()
            return Group(rows, blocks=blocks, ready=ready)
        return Group(rows, blocks=blocks)

    # -- on any thread ----------------------------------------------------------------------
    def encode(self, layer: int, indices: Sequence[int], groups: list[Group], chain: list[bytes], own: list[bytes],
               formats: list[int], counts: dict[str, int]) -> list[Item]:
        """(key, value, only if new) of the blocks read into `groups` (rows: positions in `indices`, the blocks'
        indices in their table). The first len(chain) indices are content-keyed (their formats recorded in
        `formats`), the others go under `own` (from index len(chain)). A saved-tier block already under its
        content key is neither read nor written. BlockMissingError if a saved value is gone."""
        keyed, prefix = len(chain), block_key(layer, b"")
        out: dict[int, Item] = {}  # row -> its value, in row order below (a layer's blocks lie together in LMDB)

        def key_of(row: int, fmt: int) -> tuple[bytes, bool]:
            i = indices[row]
            return (content_key(layer, fmt, chain[i]), True) if i < keyed else (own[i - keyed], False)

        for g in groups:
            if g.keys is not None:
                g = self._saved_values(layer, indices, g, chain, formats, prefix)
                if not g.rows:
                    continue
            if g.ready is not None:
                g.ready.synchronize()
            if g.values is not None:
                keys = [key_of(r, value_format(v, f"block {indices[r]} to save")) for r, v in zip(g.rows, g.values)]
                new = self._new(keys)
                sealed = [seal(k, v) for (k, _), v, fresh in zip(keys, g.values, new) if fresh]
            else:
                fmt = format_code(self.tiers.layout, g.blocks)
                keys = [key_of(r, fmt) for r in g.rows]
                new = self._new(keys)
                fresh = [n for n, is_new in enumerate(new) if is_new]
                sealed = sealed_rows(self.codec, self.tiers.layout, g.blocks, fresh,
                                     [seal(keys[n][0], b"") for n in fresh], self._threads())
            for (key, shared), r in zip(keys, g.rows):
                if shared:
                    formats[indices[r]] = key[len(BLOCK)]
            written = [(r, key) for r, key, is_new in zip(g.rows, keys, new) if is_new]
            out.update((r, (k, v, shared)) for (r, (k, shared)), v in zip(written, sealed))
        counts["blocks_shared"] += sum(len(g.rows) for g in groups) - len(out)
        counts["blocks_written"] += len(out)
        counts["bytes_written"] += sum(len(v) for _, v, _ in out.values())
        return [out[r] for r in sorted(out)]

    def _saved_values(self, layer: int, indices: Sequence[int], g: Group, chain: list[bytes], formats: list[int],
                      prefix: bytes) -> Group:
        """A saved-tier group as values to write: those already under this save's content key are checked to be
        there (their formats recorded; `keys` of the result), the others read by key and unsealed."""
        reused = {r: k for r, k in zip(g.rows, g.keys) if indices[r] < len(chain) and k.startswith(BLOCK)
                  and k[len(BLOCK) + 1:] == prefix + chain[indices[r]]}
        gone = [indices[r] for r, held in zip(reused, self.values.exists(list(reused.values()))) if not held]
        if gone:
            raise BlockMissingError(f"saved: layer {layer}'s blocks {gone[:8]} to save are gone from their save")
        for r, key in reused.items():
            formats[indices[r]] = key[len(BLOCK)]
        rows = [r for r in g.rows if r not in reused]
        keys = [k for r, k in zip(g.rows, g.keys) if r not in reused]
        values = []
        for r, key, value in zip(rows, keys, self.values.get(keys) if keys else []):
            if value is None:
                raise BlockMissingError(f"saved: layer {layer}'s block {indices[r]} to save is gone from its save")
            try:
                values.append(bytes(unseal(key, value, f"saved block {indices[r]} to save")))
            except IntegrityError:
                self.tiers.saved.integrity_errors += 1
                raise
        return Group(rows, values=values, keys=list(reused.values()))

    def _new(self, keys: list[tuple[bytes, bool]]) -> list[bool]:
        """Whether each key is to be written: own keys always, content keys unless already stored."""
        shared = [k for k, is_shared in keys if is_shared]
        held = iter(self.values.exists(shared) if shared else [])
        return [not (is_shared and next(held)) for _, is_shared in keys]

    def _threads(self) -> ThreadPoolExecutor | None:
        if self.codec[0] == "none":
            return None
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1,
                                                thread_name_prefix="kvtier-save-zstd")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
