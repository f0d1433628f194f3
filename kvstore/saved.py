"""Saved contexts: named sequences persisted where the cold tier keeps values (the ssd tier's LMDB, or
the Redis the redis tier talks to), opened lazily by any process.

Keys (tiers/saved.py's values stores; Redis puts them under its PREFIX; the ssd tier's sweep of
stale blocks touches only b"kvstore/"):
    ctx/name/<name>                         manifest (JSON), committed last, in one write: a save is
                                            complete or absent; it owns its save id's data and that
                                            of the ids in its "inherits"
    ctx/pending/<save id>                   a save in progress ({pid, host}); deleted with the commit
    ctx/block/<layer u16><chain hash>       Redis: a full block whose token ids are known, under its
                                            content key (tiers/keys.py), stored once (SET NX) and shared
                                            by every save naming it; Redis's maxmemory policy removes it
    ctx/data/<id>/b/<layer u16><index u64>  any other block (LMDB: every block) of that save
    ctx/data/<id>/m/<layer u16><part u32>   key summaries fp16 [p, 2, H, D] of PART_BYTES-sized parts
    ctx/data/<id>/h/<layer u16>             H2O scores fp32 [H, n]
    ctx/data/<id>/k/<layer u16><part u32>   key sketch codes uint8 [p, H, 2, B, D/4]
    ctx/data/<id>/t                         token ids, int64 little endian
Block values are tiers/codec.py values (checksummed, in the format their tier held: fp16, or int8
from warm/cpu); the manifest holds the xxh3-64 of every other value. A save writes under a fresh
save id, syncs, then commits the manifest. The data the replaced manifest owned is deleted after the
commit, except what live sequences of this store still read (an opened context grown and saved under
its own name): the new manifest inherits that, and a later save of the name drops it once unread (or
`delete` does). `collect_garbage` deletes what a killed save left once its writer is dead.
Opening reads the manifest, summaries, H2O scores and token ids: what a top-K (Quest) decode needs.
Sketch codes load on first use (SavedLayer.sketch reads a range of rows; kvstore/unread_codes.py
tracks the rows not read yet, which a save of the opened sequence copies from here) and blocks stay
where they are until selected (tiers/saved.py reads them in place). Deleting a saved context while a
store has it open, or replacing it from another process, makes that store's later reads of its blocks
and codes fail (BlockMissingError).
"""

from __future__ import annotations

import json
import os
import re
import socket
import uuid
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

import lmdb
import numpy as np
import torch
import xxhash

from kvstore.table import DROPPED, LayerTable
from kvstore.tierset import TierSet
from tiers.base import Tier
from tiers.errors import BlockMissingError, CapacityError, IntegrityError
from tiers.keys import block_key, chain_hashes
from tiers.saved import LmdbValues, RedisValues
from tiers.ssd import SsdTier

NAME = re.compile(r"[A-Za-z0-9_.:-]{1,200}")
_MANIFEST, _DATA, _PENDING, _BLOCK = b"ctx/name/", b"ctx/data/", b"ctx/pending/", b"ctx/block/"
_BATCH = 256  # blocks per write
PART_BYTES = 8 << 20  # sketch codes per value (Redis refuses values over 512 MiB; a 1M-token layer has 512 MiB)
VERSION = 3  # 3: sketch codes channel-major (eviction/sketch.py); a version-2 save is refused, not misread
Values = LmdbValues | RedisValues
ReadLayerCodes = Callable[[int, int, int], torch.Tensor]  # (layer, lo, hi) -> uint8 [hi - lo, H, 2, B, D/4]


@dataclass(slots=True)
class SavedLayer:
    num_tokens: int
    dropped: list[int]  # block indices H2O drop mode had freed
    summaries: torch.Tensor  # fp16 [n, 2, H, D] on the CPU
    h2o_scores: torch.Tensor  # fp32 [H, n]
    keys: list[bytes]  # the saved value of each block not dropped, in index order
    sketch: Callable[[int, int], torch.Tensor]  # (lo, hi) -> uint8 [hi - lo, H, 2, B, D/4], read then


@dataclass(slots=True)
class SavedContext:
    name: str
    token_ids: list[int] | None
    layers: list[SavedLayer]


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
        # SavedLayer.sketch of every layer load handed out and something (unread codes) still holds -> save id
        self.code_readers: weakref.WeakKeyDictionary[Callable, str] = weakref.WeakKeyDictionary()

    # -- save ------------------------------------------------------------------------------
    def save(self, name: str, tables: list[LayerTable], token_ids: list[int] | None, codes: ReadLayerCodes) -> None:
        """Persist `tables` (and the sequence's token ids, if known) as `name`; codes(layer, lo, hi) gives the
        sketch codes of rows [lo, hi) (the table's, or those an opened sequence left in its save). Returns once
        the save is durable; on failure nothing of it stays under the name (content blocks it added may stay)."""
        _check_name(name)
        self.collect_garbage()
        save_id = uuid.uuid4().hex.encode()
        pending = _PENDING + save_id
        self.values.put([(pending, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())])
        try:
            manifest = self._write_data(save_id, tables, token_ids, codes)
            inherits = self._still_read(_owned(self.values.get([_MANIFEST + name.encode()])[0]))
            manifest.update(name=name, root=self.root.hex(), inherits=inherits)
            self.values.sync()  # every block and summary durable before the manifest names them
            old = self.values.commit(_MANIFEST + name.encode(), json.dumps(manifest).encode(), pending)
        except BaseException as exc:
            if not self._committed(name, save_id):  # a commit whose reply was lost did land: keep its data
                self.values.delete_prefix(_DATA + save_id + b"/")
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
        codes = set(self.code_readers.values())
        return [s for s in save_ids if s in codes or self.tiers.saved.reads_under(_DATA + s.encode() + b"/")]

    def _delete_data(self, save_ids: set[str]) -> None:
        for save_id in sorted(save_ids):
            self.values.delete_prefix(_DATA + save_id.encode() + b"/")

    def _committed(self, name: str, save_id: bytes) -> bool:
        """Whether the manifest of `name` names this save; True when that cannot be read (keeping data that
        turns out unreferenced costs space, deleting data a manifest names loses the context)."""
        try:
            raw = self.values.get([_MANIFEST + name.encode()])[0]
        except Exception:  # noqa: BLE001 -- the save's own error is the one to report
            return True
        return raw is not None and json.loads(raw)["save_id"].encode() == save_id

    def _write_data(self, save_id: bytes, tables: list[LayerTable], token_ids: list[int] | None,
                    codes: ReadLayerCodes) -> dict:
        """Blocks, per-layer metadata and token ids under the save id; returns the manifest's other fields."""
        data, layers = _DATA + save_id + b"/", []
        chain = chain_hashes(self.root, token_ids, self.block_tokens) if token_ids and self.values.content_keyed else []
        for layer, table in enumerate(tables):
            keyed = min(len(chain), table.num_tokens // self.block_tokens)
            keys = self._block_keys(data, layer, table.num_blocks, keyed, chain)
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

    def _write_blocks(self, table: LayerTable, batch: list[int], keys: list[bytes], keyed: int) -> None:
        """One batch of a layer's blocks; a content-keyed block already stored is not written again."""
        keyed_rows = [i for i in batch if i < keyed]
        held = set()
        if keyed_rows:
            held = {i for i, there in zip(keyed_rows, self.values.exists([keys[i] for i in keyed_rows])) if there}
        todo = [i for i in batch if i not in held]
        values = self.tiers.stored_values([table.block_ids[i] for i in todo]) if todo else []
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

    def _block_keys(self, data: bytes, layer: int, n: int, keyed: int, chain: Sequence[bytes]) -> list[bytes]:
        """Each block's value key: content keys for the first `keyed`, keys of this save for the rest."""
        return [_BLOCK + block_key(layer, chain[i]) if i < keyed else
                data + b"b/" + layer.to_bytes(2, "big") + i.to_bytes(8, "big") for i in range(n)]

    # -- open ------------------------------------------------------------------------------
    def load(self, name: str) -> SavedContext:
        """The manifest, summaries, H2O scores and token ids of `name`: no block or sketch code is read."""
        _check_name(name)
        raw = self.values.get([_MANIFEST + name.encode()])[0]
        if raw is None:
            raise KeyError(f"no saved context named {name!r} (saved: {self.names()[:16]})")
        m = json.loads(bytes(raw))
        if m.get("version") != VERSION or m["root"] != self.root.hex() or \
                m["geometry"] != [self.num_kv_heads, self.head_dim, self.block_tokens]:
            raise ValueError(f"saved context {name!r} was saved by another model, geometry, block size or kvtier "
                             "version (Config.model_id, model, block_tokens must match the saving store's)")
        data = _DATA + m["save_id"].encode() + b"/"
        token_ids = None
        if m["tokens_xxh3"] is not None:
            tokens = self._verified(name, [data + b"t"], [m["tokens_xxh3"]], "token ids")[0]
            token_ids = np.frombuffer(tokens, dtype="<i8").tolist()
        chain = chain_hashes(self.root, token_ids, self.block_tokens) if any(e["keyed"] for e in m["layers"]) else []
        layers = [self._layer(name, data, layer, entry, chain, m["part_blocks"])
                  for layer, entry in enumerate(m["layers"])]
        return SavedContext(name, token_ids, layers)

    def _layer(self, name: str, data: bytes, layer: int, entry: dict, chain: list[bytes],
               part_blocks: int) -> SavedLayer:
        n, h, d, lay = entry["num_blocks"], self.num_kv_heads, self.head_dim, layer.to_bytes(2, "big")
        parts = [data + b"m/" + lay + p.to_bytes(4, "big") for p in range(len(entry["m_xxh3"]))]
        values = self._verified(name, [data + b"h/" + lay] + parts, [entry["h_xxh3"]] + entry["m_xxh3"],
                                f"layer {layer}'s summaries")
        scores = torch.from_numpy(np.frombuffer(values[0], dtype=np.float32).copy()).view(h, n)
        summaries = torch.from_numpy(np.frombuffer(b"".join(values[1:]), dtype=np.float16).copy()).view(n, 2, h, d)
        dropped = set(entry["dropped"])
        keys = self._block_keys(data, layer, n, entry["keyed"], chain)
        codes = partial(self._sketch, name, data, layer, entry, part_blocks)
        self.code_readers[codes] = data[len(_DATA):-1].decode()
        return SavedLayer(entry["num_tokens"], sorted(dropped), summaries, scores,
                          [k for i, k in enumerate(keys) if i not in dropped], codes)

    def _sketch(self, name: str, data: bytes, layer: int, entry: dict, part_blocks: int, lo: int,
                hi: int) -> torch.Tensor:
        """uint8 [hi - lo, H, 2, B, D/4]: rows [lo, hi) of the layer's sketch codes, read now (the parts
        holding them)."""
        lay, first, last = layer.to_bytes(2, "big"), lo // part_blocks, -(-hi // part_blocks)
        parts = [data + b"k/" + lay + p.to_bytes(4, "big") for p in range(first, last)]
        codes = b"".join(self._verified(name, parts, entry["k_xxh3"][first:last], f"layer {layer}'s sketch codes"))
        shape = (-1, self.num_kv_heads, 2, self.block_tokens, self.head_dim // 4)
        rows = torch.from_numpy(np.frombuffer(codes, dtype=np.uint8).copy()).view(shape)
        return rows[lo - first * part_blocks: hi - first * part_blocks]

    def _verified(self, name: str, keys: list[bytes], digests: list[int], what: str) -> list[bytes]:
        values = self.values.get(keys)
        if any(v is None for v in values):
            raise BlockMissingError(f"saved context {name!r}: {what} are gone (deleted or replaced after it was "
                                    "opened, or evicted by Redis's maxmemory policy)")
        if any(xxhash.xxh3_64_intdigest(v) != want for v, want in zip(values, digests)):
            raise IntegrityError(f"saved context {name!r}: {what} are damaged (checksum mismatch)")
        return values

    # -- listing and deleting --------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(k[len(_MANIFEST):].decode() for k in self.values.keys(_MANIFEST))

    def delete(self, name: str) -> None:
        """The manifest and the data it owns; content-keyed blocks stay for other saves naming them."""
        _check_name(name)
        raw = self.values.pop(_MANIFEST + name.encode())  # one step: a save of the name meanwhile is kept whole
        if raw is None:
            raise KeyError(f"no saved context named {name!r}")
        self._delete_data(set(_owned(raw)))

    def collect_garbage(self) -> int:
        """Delete the data of saves whose writer died before its manifest (this host's dead pids only);
        returns how many."""
        pending = self.values.keys(_PENDING)
        infos = self.values.get(pending)
        dead = [k[len(_PENDING):] for k, info in zip(pending, infos) if info is not None and
                json.loads(info)["host"] == socket.gethostname() and not _alive(json.loads(info)["pid"])]
        if dead:  # a writer killed between the manifest's SET and the pending key's delete saved completely
            manifests = self.values.get(self.values.keys(_MANIFEST))
            live = {s.encode() for m in manifests for s in _owned(m)}
            for save_id in dead:
                if save_id not in live:
                    self.values.delete_prefix(_DATA + save_id + b"/")
                self.values.delete([_PENDING + save_id])
        return len(dead)


def _owned(manifest: bytes | None) -> list[str]:
    """The save ids whose data a manifest owns: its own and those it inherited (none for no manifest)."""
    if manifest is None:
        return []
    m = json.loads(manifest)
    return [m["save_id"]] + m.get("inherits", [])


def _bytes(t: torch.Tensor) -> bytes:
    return t.cpu().contiguous().numpy().tobytes()


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"a saved context's name must match {NAME.pattern}, got {name!r}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
