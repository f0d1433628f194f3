"""Saved contexts: named sequences persisted where the cold tier keeps values (the ssd tier's LMDB, or
the Redis the redis tier talks to), opened lazily by any process. This module saves, lists and deletes
them and keeps track of who owns which data; the key layout and opening are kvstore/contexts/opening.py's.

A save writes under a fresh save id, syncs, then commits the manifest. The data the replaced manifest
owned is deleted after the commit, except what live sequences of this store still read (an opened
context grown and saved under its own name): the new manifest inherits that, and a later save of the
name drops it once unread (or `delete` does). Before the commit (or a delete's taking of the manifest)
the save ids to delete are recorded under ctx/pending/delete/, so `collect_garbage` finds data a writer killed
after its commit left; it also deletes what a killed save left before its commit, once its writer is dead.
Through Redis, blocks are shared by content key, so a save there needs Config.model_id (ValueError).
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from functools import partial
from typing import Callable, Iterable, Sequence

import lmdb
import numpy as np
import torch

from kvstore.contexts.opening import BLOCK, DATA, MANIFEST, PENDING, RETIRED, SAVE_ID, VERSION, SavedContext, SavedReader, \
    Values, check_name, content_key, own_keys, owned_ids, pack_formats, seal_manifest, value_digest
from kvstore.blocks.table import DROPPED, LayerTable
from kvstore.blocks.tierset import COLD_TIER, SAVED_TIER, TierSet
from tiers.base import Tier
from tiers.codec import Codec
from tiers.errors import BlockMissingError, CapacityError
from tiers.keys import chain_hashes
from tiers.layout import FORMAT_CODES
from tiers.saved import seal, value_format
from tiers.saved_values import LmdbValues, RedisValues
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

    def __init__(self, values: Values, tiers: TierSet, root: bytes, model_id: str) -> None:
        self.values, self.tiers, self.root = values, tiers, root
        layout = tiers.layout
        self.num_kv_heads, self.head_dim, self.block_tokens = layout.num_kv_heads, layout.head_dim, layout.block_tokens
        self.sketch_row = self.num_kv_heads * 2 * self.block_tokens * self.head_dim // 4  # bytes per block
        self.part_blocks = max(1, PART_BYTES // self.sketch_row)
        self.reader = SavedReader(values, layout, root, model_id)

    def load(self, name: str) -> SavedContext:
        """The manifest and token ids of `name`; its layers read their summaries when handed their tensors."""
        return self.reader.load(name)

    # -- save ------------------------------------------------------------------------------
    def save(self, name: str, tables: list[LayerTable], token_ids: list[int] | None, codes: ReadLayerCodes) -> None:
        """Persist `tables` (and the sequence's token ids, if known) as `name`; codes(layer, lo, hi) gives the
        sketch codes of rows [lo, hi) (the table's, or those an opened sequence left in its save). Returns once
        the save is durable; on failure nothing of it stays under the name (content blocks it added may stay)."""
        check_name(name)
        self.reader.check_model_id()
        self.collect_garbage()
        save_id = uuid.uuid4().hex.encode()
        pending = PENDING + save_id
        self.values.put([(pending, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())])
        try:
            manifest = self._write_data(save_id, tables, token_ids, codes)
            earlier = owned_ids(name, self.reader.manifest(name)) or []  # a damaged manifest names nothing
            inherits = self._still_read(earlier)
            manifest.update(name=name, root=self.root.hex(), inherits=inherits)
            self._retire(name, set(earlier) - set(inherits))
            self.values.sync()  # every block and summary durable before the manifest names them
            old = self.values.commit(MANIFEST + name.encode(), seal_manifest(name, manifest), pending)
        except BaseException as exc:
            if not self._committed(name, save_id):  # a commit whose reply was lost did land: keep its data
                self.values.delete_prefix(DATA + save_id + b"/")
                self.values.delete([pending])
            if isinstance(exc, lmdb.MapFullError):
                raise CapacityError(f"saving {name!r}: the ssd tier's LMDB map (2 x ssd_bytes) is full") from exc
            raise
        replaced = set(owned_ids(name, old) or []) - set(inherits)  # `old` is the manifest read above, unless
        self._retire(name, replaced - set(earlier))  # another process saved the name meanwhile
        self.values.sync()
        self._delete_data(replaced)

    def _still_read(self, save_ids: list[str]) -> list[str]:
        """Those of `save_ids` whose data live sequences of this store still read: blocks left in the saved
        tier, or sketch codes not loaded yet."""
        codes = set(self.reader.code_readers.values())
        return [s for s in save_ids if s in codes or self.tiers.saved.reads_under(DATA + s.encode() + b"/")]

    def _retire(self, name: str, save_ids: Iterable[str]) -> None:
        """Record that the data of `save_ids` goes once the manifest of `name` no longer owns it."""
        keys = [RETIRED + s.encode() for s in sorted(save_ids)]
        self.values.put([(k, value_digest(k, name.encode()).to_bytes(8, "little") + name.encode()) for k in keys])

    def _delete_data(self, save_ids: Iterable[str]) -> None:
        """The data of `save_ids`, then their retired records."""
        for save_id in sorted(save_ids):
            self.values.delete_prefix(DATA + save_id.encode() + b"/")
            self.values.delete([RETIRED + save_id.encode()])

    def _committed(self, name: str, save_id: bytes) -> bool:
        """Whether the manifest of `name` names this save; True when that cannot be read (keeping data that
        turns out unreferenced costs space, deleting data a manifest names loses the context)."""
        try:
            owned = owned_ids(name, self.reader.manifest(name))
        except Exception:  # noqa: BLE001 -- the save's own error is the one to report
            return True
        return owned is None or save_id.decode() in owned[:1]

    def _write_data(self, save_id: bytes, tables: list[LayerTable], token_ids: list[int] | None,
                    codes: ReadLayerCodes) -> dict:
        """Blocks, per-layer metadata and token ids under the save id; returns the manifest's other fields."""
        data, layers = DATA + save_id + b"/", []
        chain = chain_hashes(self.root, token_ids, self.block_tokens) if token_ids and self.values.content_keyed else []
        for layer, table in enumerate(tables):
            keyed = min(len(chain), table.num_tokens // self.block_tokens)
            own, formats = own_keys(data, layer, keyed, table.num_blocks), [0] * keyed  # dropped: never read
            live = [i for i, b in enumerate(table.block_ids) if b != DROPPED]
            for lo in range(0, len(live), _BATCH):
                self._write_blocks(layer, table, live[lo: lo + _BATCH], chain[:keyed], own, formats)
            layers.append(self._write_meta(data, layer, table, formats, partial(codes, layer)))
        tokens = None if token_ids is None else np.asarray(token_ids, dtype="<i8").tobytes()
        if tokens is not None:
            self.values.put([(data + b"t", tokens)])
        return {"version": VERSION, "save_id": save_id.decode(), "layers": layers,
                "geometry": [self.num_kv_heads, self.head_dim, self.block_tokens], "part_blocks": self.part_blocks,
                "tokens_xxh3": None if tokens is None else value_digest(data + b"t", tokens)}

    def stored_values(self, ids: Sequence[int]) -> list[bytes]:
        """Each block as one codec value (tiers/codec.py), in its tier's format (fp16 or int8): values the
        saved tier (checked to name their keys) or an ssd cold tier hold are handed over as they are, the
        others encoded."""
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

    def _write_blocks(self, layer: int, table: LayerTable, batch: list[int], chain: list[bytes], own: list[bytes],
                      formats: list[int]) -> None:
        """One batch of a layer's blocks, each sealed under its key (tiers/saved.py): the first len(chain) under
        their content keys, one per format (recorded in `formats`), stored once: a value already there is not
        written again, and a block the saved tier reads from its content key is not read at all; the others
        under the save's own keys (`own`, from index len(chain))."""
        keyed = len(chain)
        keys = {i: k for i in batch if i < keyed and
                (k := self.tiers.saved.key(table.block_ids[i])) in [content_key(layer, f, chain[i])
                                                                     for f in FORMAT_CODES.values()]}
        todo = [i for i in batch if i not in keys]
        values = dict(zip(todo, self.stored_values([table.block_ids[i] for i in todo]))) if todo else {}
        for i, v in values.items():
            keys[i] = own[i - keyed] if i >= keyed else \
                content_key(layer, value_format(v, f"layer {layer}'s block {i} to save"), chain[i])
        shared = [i for i in batch if i < keyed]
        there = self.values.exists([keys[i] for i in shared]) if shared else []
        gone = [i for i, held in zip(shared, there) if not held and i not in values]
        if gone:
            raise BlockMissingError(f"saved: layer {layer}'s blocks {gone[:8]} to save are gone from their save")
        for i in shared:
            formats[i] = keys[i][len(BLOCK)]
        self.values.put_new([(keys[i], seal(keys[i], values[i])) for i, held in zip(shared, there) if not held])
        self.values.put([(keys[i], seal(keys[i], values[i])) for i in batch if i >= keyed])

    def _write_meta(self, data: bytes, layer: int, table: LayerTable, formats: list[int],
                    codes: Callable[[int, int], torch.Tensor]) -> dict:
        n, lay, p = table.num_blocks, layer.to_bytes(2, "big"), self.part_blocks
        scores = table.h2o_scores[:, :n].cpu().contiguous().numpy().tobytes() if n else b""
        items = [(data + b"h/" + lay, scores)]
        for part, lo in enumerate(range(0, n, p)):
            hi = min(n, lo + p)
            items.append((data + b"m/" + lay + part.to_bytes(4, "big"), _bytes(table.summaries[lo:hi])))
            items.append((data + b"k/" + lay + part.to_bytes(4, "big"), _bytes(codes(lo, hi))))
        self.values.put(items)
        digests = [value_digest(k, v) for k, v in items]
        return {"num_tokens": table.num_tokens, "num_blocks": n, "keyed": len(formats), "int8": pack_formats(formats),
                "dropped": [i for i, b in enumerate(table.block_ids) if b == DROPPED],
                "h_xxh3": digests[0], "m_xxh3": digests[1::2], "k_xxh3": digests[2::2]}

    # -- listing and deleting --------------------------------------------------------------
    def names(self) -> list[str]:
        return self.reader.names()

    def delete(self, name: str) -> None:
        """The manifest and the data it owns; content-keyed blocks stay for other saves naming them. What it owns
        is recorded as retired first: a delete killed part way leaves its data to collect_garbage."""
        check_name(name)
        earlier = owned_ids(name, self.reader.manifest(name)) or []
        self._retire(name, earlier)
        raw = self.values.pop(MANIFEST + name.encode())  # one step: a save of the name meanwhile is kept whole
        if raw is None:
            raise KeyError(f"no saved context named {name!r}")
        owned = owned_ids(name, raw) or []  # a damaged manifest names nothing: its data stays
        self._retire(name, set(owned) - set(earlier))
        self._delete_data(owned)

    def collect_garbage(self) -> int:
        """Delete saved data that no manifest owns and no live writer writes; returns how many saves' data went:
        that of saves whose writer died before its commit (this host's dead pids only), and that of replaced or
        deleted saves whose writer stopped before deleting it (retired). Keeps whatever a manifest that cannot
        be read (damaged) might own."""
        keys = self.values.keys(PENDING)  # writers and retired data: one scan
        records = dict(zip(keys, self.values.get(keys)))
        retired = {k: v for k, v in records.items() if k.startswith(RETIRED)}
        writers = {k: v for k, v in records.items() if k not in retired}
        return self._collect_dead_writers(writers) + self._collect_retired(retired)

    def _collect_dead_writers(self, writers: dict[bytes, bytes | None]) -> int:
        dead = [k[len(PENDING):] for k, info in writers.items() if _dead_here(info)]
        if not dead:
            return 0
        names = self.values.keys(MANIFEST)
        owned = [owned_ids(k[len(MANIFEST):].decode(errors="replace"), raw) for k, raw in
                 zip(names, self.values.get(names))]
        if None in owned:  # a damaged manifest might own one of them
            return 0
        live = {s for ids in owned for s in ids}
        for save_id in dead:  # one a manifest owns committed (killed before deleting its pending key): kept
            if save_id.decode(errors="replace") not in live:
                self.values.delete_prefix(DATA + save_id + b"/")
            self.values.delete([PENDING + save_id])
        return len(dead)

    def _collect_retired(self, retired: dict[bytes, bytes | None]) -> int:
        freed = 0
        for key, raw in retired.items():
            name = _retired_name(key, raw)
            if name is None:  # a damaged record names no data it could be trusted with
                continue
            save_id = key[len(RETIRED):].decode()
            owned = owned_ids(name, self.reader.manifest(name))
            if owned is not None and save_id not in owned and SAVE_ID.fullmatch(save_id):
                self._delete_data([save_id])
                freed += 1
        return freed


def _bytes(t: torch.Tensor) -> bytes:
    return t.cpu().contiguous().numpy().tobytes()


def _retired_name(key: bytes, raw: bytes | None) -> str | None:
    """The name a retired record names (None: gone or damaged)."""
    if raw is None or len(raw) < 8 or int.from_bytes(raw[:8], "little") != value_digest(key, raw[8:]):
        return None
    return raw[8:].decode()


def _dead_here(info: bytes | None) -> bool:
    """Whether a pending save's writer ran on this host and is dead (a damaged record: not known to be)."""
    try:
        writer = json.loads(info)
        host, pid = writer["host"], writer["pid"]
    except (TypeError, ValueError, KeyError):
        return False
    if host != socket.gethostname() or not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, ValueError):
        return False
    return False
