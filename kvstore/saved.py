"""Saved contexts: named sequences persisted where the cold tier keeps values (the ssd tier's LMDB, or
the Redis the redis tier talks to), opened lazily by any process. This module saves, lists and deletes
them and keeps track of who owns which data; the key layout and opening are kvstore/saved_reader.py's.

A save writes under a fresh save id, syncs, then commits the manifest. The data the replaced manifest
owned is deleted after the commit, except what live sequences of this store still read (an opened
context grown and saved under its own name): the new manifest inherits that, and a later save of the
name drops it once unread (or `delete` does). `collect_garbage` deletes what a killed save left once its
writer is dead.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from functools import partial
from typing import Callable, Sequence

import lmdb
import numpy as np
import torch
import xxhash

from kvstore.saved_reader import DATA, MANIFEST, PENDING, VERSION, SavedContext, SavedReader, Values, check_name, \
    value_keys
from kvstore.table import DROPPED, LayerTable
from kvstore.tierset import COLD_TIER, SAVED_TIER, TierSet
from tiers.base import Tier
from tiers.codec import Codec
from tiers.errors import BlockMissingError, CapacityError
from tiers.keys import chain_hashes
from tiers.saved import LmdbValues, RedisValues
from tiers.ssd import SsdTier

_BATCH = 256  # blocks per write
PART_BYTES = 8 << 20  # sketch codes per value (Redis refuses values over 512 MiB; a 1M-token layer has 512 MiB)
ReadLayerCodes = Callable[[int, int, int], torch.Tensor]  # (layer, lo, hi) -> uint8 [hi - lo, H, 2, B, D/4]


def values_store(cold: Tier) -> Values | None:
    """Where saved contexts live beside `cold`: its LMDB, its Redis; None for the sidecar."""
    if isinstance(cold, SsdTier):
        return LmdbValues(cold.env)
    return RedisValues(cold.client) if cold.name == "redis" else None


class SavedContexts:
    """Save, load, list and delete saved contexts in `values`; blocks to save are read from `tiers`."""

    def __init__(self, values: Values, tiers: TierSet, root: bytes) -> None:
        self.values, self.tiers, self.root = values, tiers, root
        layout = tiers.layout
        self.num_kv_heads, self.head_dim, self.block_tokens = layout.num_kv_heads, layout.head_dim, layout.block_tokens
        self.sketch_row = self.num_kv_heads * 2 * self.block_tokens * self.head_dim // 4  # bytes per block
        self.part_blocks = max(1, PART_BYTES // self.sketch_row)
        self.reader = SavedReader(values, layout, root)

    def load(self, name: str) -> SavedContext:
        """The manifest and token ids of `name`; its layers read their summaries when handed their tensors."""
        return self.reader.load(name)

    # -- save ------------------------------------------------------------------------------
    def save(self, name: str, tables: list[LayerTable], token_ids: list[int] | None, codes: ReadLayerCodes) -> None:
        """Persist `tables` (and the sequence's token ids, if known) as `name`; codes(layer, lo, hi) gives the
        sketch codes of rows [lo, hi) (the table's, or those an opened sequence left in its save). Returns once
        the save is durable; on failure nothing of it stays under the name (content blocks it added may stay)."""
        check_name(name)
        self.collect_garbage()
        save_id = uuid.uuid4().hex.encode()
        pending = PENDING + save_id
        self.values.put([(pending, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())])
        try:
            manifest = self._write_data(save_id, tables, token_ids, codes)
            inherits = self._still_read(_owned(self.reader.manifest(name)))
            manifest.update(name=name, root=self.root.hex(), inherits=inherits)
            self.values.sync()  # every block and summary durable before the manifest names them
            old = self.values.commit(MANIFEST + name.encode(), json.dumps(manifest).encode(), pending)
        except BaseException as exc:
            if not self._committed(name, save_id):  # a commit whose reply was lost did land: keep its data
                self.values.delete_prefix(DATA + save_id + b"/")
                self.values.delete([pending])
            if isinstance(exc, lmdb.MapFullError):
                raise CapacityError(f"saving {name!r}: the ssd tier's LMDB map (2 x ssd_bytes) is full") from exc
            raise
        self.values.sync()
        self._delete_data(set(_owned(old)) - set(inherits))  # `old` is the manifest read above, unless
        # another process saved the name meanwhile: then what that one owned is not read here and goes

    def _still_read(self, save_ids: list[str]) -> list[str]:
        """Those of `save_ids` whose data live sequences of this store still read: blocks left in the saved
        tier, or sketch codes not loaded yet."""
        codes = set(self.reader.code_readers.values())
        return [s for s in save_ids if s in codes or self.tiers.saved.reads_under(DATA + s.encode() + b"/")]

    def _delete_data(self, save_ids: set[str]) -> None:
        for save_id in sorted(save_ids):
            self.values.delete_prefix(DATA + save_id.encode() + b"/")

    def _committed(self, name: str, save_id: bytes) -> bool:
        """Whether the manifest of `name` names this save; True when that cannot be read (keeping data that
        turns out unreferenced costs space, deleting data a manifest names loses the context)."""
        try:
            raw = self.reader.manifest(name)
        except Exception:  # noqa: BLE001 -- the save's own error is the one to report
            return True
        return raw is not None and json.loads(raw)["save_id"].encode() == save_id

    def _write_data(self, save_id: bytes, tables: list[LayerTable], token_ids: list[int] | None,
                    codes: ReadLayerCodes) -> dict:
        """Blocks, per-layer metadata and token ids under the save id; returns the manifest's other fields."""
        data, layers = DATA + save_id + b"/", []
        chain = chain_hashes(self.root, token_ids, self.block_tokens) if token_ids and self.values.content_keyed else []
        for layer, table in enumerate(tables):
            keyed = min(len(chain), table.num_tokens // self.block_tokens)
            keys = value_keys(data, layer, table.num_blocks, keyed, chain)
            live = [i for i, b in enumerate(table.block_ids) if b != DROPPED]
            for lo in range(0, len(live), _BATCH):
                self._write_blocks(table, live[lo: lo + _BATCH], keys, keyed)
            layers.append(self._write_meta(data, layer, table, keyed, partial(codes, layer)))
        tokens = None if token_ids is None else np.asarray(token_ids, dtype="<i8").tobytes()
        if tokens is not None:
            self.values.put([(data + b"t", tokens)])
        return {"version": VERSION, "save_id": save_id.decode(), "layers": layers,
                "geometry": [self.num_kv_heads, self.head_dim, self.block_tokens], "part_blocks": self.part_blocks,
                "tokens_xxh3": None if tokens is None else xxhash.xxh3_64_intdigest(tokens)}

    def stored_values(self, ids: Sequence[int]) -> list[bytes]:
        """Each block as one stored value (tiers/codec.py), in its tier's format (fp16 or int8): values the
        saved tier or an ssd cold tier hold are handed over as they are, the others encoded."""
        values: dict[int, bytes] = {}
        for tier, group in self.tiers.blocks.by_tier(ids).items():
            if tier == SAVED_TIER:
                got = self.tiers.saved.values(group)
            elif tier == COLD_TIER and isinstance(self.tiers.cold, SsdTier):
                got = self.tiers.cold.get_values([self.tiers.cold.key(i) for i in group])
            else:
                blocks = self.tiers.stack[tier].get(group).to("cpu")
                codec = Codec(*getattr(self.tiers.cold, "codec_args", ("zstd", 1)))
                got = [codec.encode(self.tiers.layout, blocks, row) for row in range(len(group))]
            if any(v is None for v in got):
                raise BlockMissingError(f"{self.tiers.stack[tier].name}: a block to save is gone")
            values.update(zip(group, got))
        return [values[i] for i in ids]

    def _write_blocks(self, table: LayerTable, batch: list[int], keys: list[bytes], keyed: int) -> None:
        """One batch of a layer's blocks; a content-keyed block already stored is not written again."""
        keyed_rows = [i for i in batch if i < keyed]
        held = set()
        if keyed_rows:
            held = {i for i, there in zip(keyed_rows, self.values.exists([keys[i] for i in keyed_rows])) if there}
        todo = [i for i in batch if i not in held]
        values = self.stored_values([table.block_ids[i] for i in todo]) if todo else []
        self.values.put_new([(keys[i], v) for i, v in zip(todo, values) if i < keyed])
        self.values.put([(keys[i], v) for i, v in zip(todo, values) if i >= keyed])

    def _write_meta(self, data: bytes, layer: int, table: LayerTable, keyed: int,
                    codes: Callable[[int, int], torch.Tensor]) -> dict:
        n, lay, p = table.num_blocks, layer.to_bytes(2, "big"), self.part_blocks
        scores = table.h2o_scores[:, :n].cpu().contiguous().numpy().tobytes() if n else b""
        items = [(data + b"h/" + lay, scores)]
        for part, lo in enumerate(range(0, n, p)):
            hi = min(n, lo + p)
            items.append((data + b"m/" + lay + part.to_bytes(4, "big"), _bytes(table.summaries[lo:hi])))
            items.append((data + b"k/" + lay + part.to_bytes(4, "big"), _bytes(codes(lo, hi))))
        self.values.put(items)
        return {"num_tokens": table.num_tokens, "num_blocks": n, "keyed": keyed,
                "dropped": [i for i, b in enumerate(table.block_ids) if b == DROPPED],
                "h_xxh3": xxhash.xxh3_64_intdigest(scores),
                "m_xxh3": [xxhash.xxh3_64_intdigest(v) for k, v in items[1::2]],
                "k_xxh3": [xxhash.xxh3_64_intdigest(v) for k, v in items[2::2]]}

    # -- listing and deleting --------------------------------------------------------------
    def names(self) -> list[str]:
        return self.reader.names()

    def delete(self, name: str) -> None:
        """The manifest and the data it owns; content-keyed blocks stay for other saves naming them."""
        check_name(name)
        raw = self.values.pop(MANIFEST + name.encode())  # one step: a save of the name meanwhile is kept whole
        if raw is None:
            raise KeyError(f"no saved context named {name!r}")
        self._delete_data(set(_owned(raw)))

    def collect_garbage(self) -> int:
        """Delete the data of saves whose writer died before its manifest (this host's dead pids only);
        returns how many."""
        pending = self.values.keys(PENDING)
        infos = self.values.get(pending)
        dead = [k[len(PENDING):] for k, info in zip(pending, infos) if info is not None and
                json.loads(info)["host"] == socket.gethostname() and not _alive(json.loads(info)["pid"])]
        if dead:  # a writer killed between the manifest's SET and the pending key's delete saved completely
            manifests = self.values.get(self.values.keys(MANIFEST))
            live = {s.encode() for m in manifests for s in _owned(m)}
            for save_id in dead:
                if save_id not in live:
                    self.values.delete_prefix(DATA + save_id + b"/")
                self.values.delete([PENDING + save_id])
        return len(dead)


def _owned(manifest: bytes | None) -> list[str]:
    """The save ids whose data a manifest owns: its own and those it inherited (none for no manifest)."""
    if manifest is None:
        return []
    m = json.loads(manifest)
    return [m["save_id"]] + m.get("inherits", [])


def _bytes(t: torch.Tensor) -> bytes:
    return t.cpu().contiguous().numpy().tobytes()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
