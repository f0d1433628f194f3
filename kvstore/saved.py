"""Saved contexts: named sequences persisted in the cold ssd tier's LMDB, opened lazily by any process.

Keys, under their own prefix (the ssd tier's sweep of stale blocks touches only b"kvstore/"):
    ctx/name/<name>                               manifest (JSON), committed last, in one transaction
    ctx/data/<save id>/b/<layer u16><index u64>   one block value (tiers/codec.py: checksummed, in the
                                                  format its tier held it: fp16, or int8 from warm/cpu)
    ctx/data/<save id>/m/<layer u16>              the layer's key summaries fp16 [n, 2, H, D], its H2O
                                                  scores fp32 [H, n], its key sketch uint8 [n, H, 2, B, D/4]
    ctx/data/<save id>/t                          token ids, int64 little endian
    ctx/pending/<save id>                         a save in progress ({pid, host}); deleted in the
                                                  manifest's transaction
A save writes everything under a fresh save id, syncs, then commits the manifest (replacing an
older one, whose data is deleted after). So an acknowledged save is complete and a killed one
left only data no manifest names; `collect_garbage` deletes that once its writer is dead.
Opening reads the manifest, summaries, sketches and token ids; blocks stay where they are until selected
(tiers/saved.py reads them in place). Replacing or deleting a saved context while another store
has it open makes that store's reads of its blocks fail (BlockMissingError).
"""

from __future__ import annotations

import json
import os
import re
import socket
import uuid
from dataclasses import dataclass

import lmdb
import numpy as np
import torch
import xxhash

from kvstore.table import DROPPED, LayerTable
from tiers.errors import CapacityError
from tiers.ssd import SsdTier

NAME = re.compile(r"[A-Za-z0-9_.:-]{1,200}")
_MANIFEST, _DATA, _PENDING = b"ctx/name/", b"ctx/data/", b"ctx/pending/"
_BATCH = 256  # blocks per write transaction
VERSION = 1


@dataclass(slots=True)
class SavedLayer:
    num_tokens: int
    dropped: list[int]  # block indices H2O drop mode had freed
    summaries: torch.Tensor  # fp16 [n, 2, H, D] on the CPU
    h2o_scores: torch.Tensor  # fp32 [H, n]
    sketch: torch.Tensor  # uint8 [n, H, 2, B, D/4]
    keys: list[bytes]  # the saved value of each block not dropped, in index order


@dataclass(slots=True)
class SavedContext:
    name: str
    token_ids: list[int] | None
    layers: list[SavedLayer]


class SavedContexts:
    def __init__(self, ssd: SsdTier, root: bytes, num_kv_heads: int, head_dim: int, block_tokens: int) -> None:
        self.env, self.root = ssd.env, root
        self.num_kv_heads, self.head_dim, self.block_tokens = num_kv_heads, head_dim, block_tokens

    # -- save ------------------------------------------------------------------------------
    def save(self, name: str, tables: list[LayerTable], token_ids: list[int] | None, encode) -> None:
        """Persist `tables` (and the sequence's token ids, if known) as `name`; `encode(block ids)` gives
        each block's stored value. Returns once the save is durable; on failure nothing of it stays."""
        _check_name(name)
        self.collect_garbage()
        save_id = uuid.uuid4().hex.encode()
        self._put([(_PENDING + save_id, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())])
        try:
            manifest = self._write_data(save_id, tables, token_ids, encode)
            manifest.update(name=name, root=self.root.hex())
            self.env.sync(True)  # every block and summary durable before the manifest names them
            with self.env.begin(write=True) as txn:
                old = txn.get(_MANIFEST + name.encode())
                txn.put(_MANIFEST + name.encode(), json.dumps(manifest).encode())
                txn.delete(_PENDING + save_id)
        except BaseException as exc:
            self._delete_data(save_id)
            self._delete_keys([_PENDING + save_id])
            if isinstance(exc, lmdb.MapFullError):
                raise CapacityError(f"saving {name!r}: the ssd tier's LMDB map (2 x ssd_bytes) is full") from exc
            raise
        self.env.sync(True)
        if old is not None:
            self._delete_data(json.loads(old)["save_id"].encode())

    def _write_data(self, save_id: bytes, tables: list[LayerTable], token_ids: list[int] | None, encode) -> dict:
        """Blocks, per-layer metadata and token ids under the save id; returns the manifest's other fields."""
        data, layers = _DATA + save_id + b"/", []
        for layer, table in enumerate(tables):
            live = [i for i, b in enumerate(table.block_ids) if b != DROPPED]
            for lo in range(0, len(live), _BATCH):
                batch = live[lo: lo + _BATCH]
                values = encode([table.block_ids[i] for i in batch])
                self._put([(_block_key(data, layer, i), v) for i, v in zip(batch, values)])
            meta = _layer_bytes(table)
            self._put([(data + b"m/" + layer.to_bytes(2, "big"), meta)])
            layers.append({"num_tokens": table.num_tokens, "num_blocks": table.num_blocks,
                           "dropped": [i for i, b in enumerate(table.block_ids) if b == DROPPED],
                           "meta_xxh3": xxhash.xxh3_64_intdigest(meta)})
        tokens = None if token_ids is None else np.asarray(token_ids, dtype="<i8").tobytes()
        if tokens is not None:
            self._put([(data + b"t", tokens)])
        return {"version": VERSION, "save_id": save_id.decode(), "layers": layers,
                "geometry": [self.num_kv_heads, self.head_dim, self.block_tokens],
                "tokens_xxh3": None if tokens is None else xxhash.xxh3_64_intdigest(tokens)}

    def _put(self, items: list[tuple[bytes, bytes]]) -> None:
        with self.env.begin(write=True) as txn:
            for key, value in items:
                txn.put(key, value)

    def _delete_keys(self, keys: list[bytes]) -> None:
        with self.env.begin(write=True) as txn:
            for key in keys:
                txn.delete(key)

    # -- open ------------------------------------------------------------------------------
    def load(self, name: str) -> SavedContext:
        """The manifest, summaries and token ids of `name` (no block is read)."""
        _check_name(name)
        with self.env.begin(buffers=True) as txn:  # views into the map: each value is copied once, below
            raw = txn.get(_MANIFEST + name.encode())
            if raw is None:
                raise KeyError(f"no saved context named {name!r} (saved: {self.names()[:16]})")
            m = json.loads(bytes(raw))
            if m["version"] != VERSION or m["root"] != self.root.hex() or \
                    m["geometry"] != [self.num_kv_heads, self.head_dim, self.block_tokens]:
                raise ValueError(f"saved context {name!r} was saved by another model, geometry or block size "
                                 "(Config.model_id, model, block_tokens must match the saving store's)")
            data = _DATA + m["save_id"].encode() + b"/"
            layers = [self._layer(txn, data, layer, entry) for layer, entry in enumerate(m["layers"])]
            token_ids = None
            if m["tokens_xxh3"] is not None:
                tokens = txn.get(data + b"t")
                if tokens is None or xxhash.xxh3_64_intdigest(tokens) != m["tokens_xxh3"]:
                    raise ValueError(f"saved context {name!r}: its token ids are damaged")
                token_ids = np.frombuffer(tokens, dtype="<i8").tolist()
        return SavedContext(name, token_ids, layers)

    def _layer(self, txn: lmdb.Transaction, data: bytes, layer: int, entry: dict) -> SavedLayer:
        meta = txn.get(data + b"m/" + layer.to_bytes(2, "big"))
        if meta is None or xxhash.xxh3_64_intdigest(meta) != entry["meta_xxh3"]:
            raise ValueError(f"saved context: layer {layer}'s summaries are damaged")
        n, h, d, b = entry["num_blocks"], self.num_kv_heads, self.head_dim, self.block_tokens
        ends = np.cumsum([n * 2 * h * d * 2, h * n * 4])
        summaries = torch.from_numpy(np.frombuffer(meta[: ends[0]], dtype=np.float16).copy()).view(n, 2, h, d)
        scores = torch.from_numpy(np.frombuffer(meta[ends[0]: ends[1]], dtype=np.float32).copy()).view(h, n)
        sketch = torch.from_numpy(np.frombuffer(meta[ends[1]:], dtype=np.uint8).copy()).view(n, h, 2, b, d // 4)
        dropped = set(entry["dropped"])
        keys = [_block_key(data, layer, i) for i in range(n) if i not in dropped]
        return SavedLayer(entry["num_tokens"], sorted(dropped), summaries, scores, sketch, keys)

    # -- listing and deleting --------------------------------------------------------------
    def names(self) -> list[str]:
        with self.env.begin() as txn:
            return [k[len(_MANIFEST):].decode() for k, _ in _prefix_items(txn, _MANIFEST)]

    def delete(self, name: str) -> None:
        _check_name(name)
        with self.env.begin(write=True) as txn:
            raw = txn.get(_MANIFEST + name.encode())
            if raw is None:
                raise KeyError(f"no saved context named {name!r}")
            txn.delete(_MANIFEST + name.encode())
        self._delete_data(json.loads(raw)["save_id"].encode())

    def collect_garbage(self) -> int:
        """Delete the data of saves whose writer died before its manifest (this host's dead pids only);
        returns how many."""
        with self.env.begin() as txn:
            pending = [(k, json.loads(v)) for k, v in _prefix_items(txn, _PENDING)]
        dead = [k[len(_PENDING):] for k, info in pending
                if info["host"] == socket.gethostname() and not _alive(info["pid"])]
        for save_id in dead:
            self._delete_data(save_id)
            self._delete_keys([_PENDING + save_id])
        return len(dead)

    def _delete_data(self, save_id: bytes) -> None:
        prefix = _DATA + save_id + b"/"
        while True:
            with self.env.begin(write=True) as txn:
                cursor, n = txn.cursor(), 0
                if not cursor.set_range(prefix):
                    return
                while bytes(cursor.key()[: len(prefix)]) == prefix and n < 4 * _BATCH:
                    cursor.delete()  # moves to the next key
                    n += 1
                if n == 0:
                    return


def _prefix_items(txn: lmdb.Transaction, prefix: bytes):
    cursor = txn.cursor()
    if not cursor.set_range(prefix):
        return
    for key, value in cursor:
        if not key.startswith(prefix):
            return
        yield key, value


def _block_key(data: bytes, layer: int, index: int) -> bytes:
    return data + b"b/" + layer.to_bytes(2, "big") + index.to_bytes(8, "big")


def _layer_bytes(table: LayerTable) -> bytes:
    n = table.num_blocks
    if not n:
        return b""
    return b"".join(t.cpu().contiguous().numpy().tobytes()
                    for t in (table.summaries[:n], table.h2o_scores[:, :n], table.sketch[:n]))


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
