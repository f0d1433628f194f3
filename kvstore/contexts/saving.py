"""Saved contexts: named sequences persisted where the cold tier keeps values (the ssd tier's LMDB, or
the Redis the redis tier talks to), opened lazily by any process. This module saves, lists and deletes
them and keeps track of who owns which data; the key layout is kvstore/contexts/saved_format.py's, opening kvstore/contexts/opening.py's.

A save (begin, its data, sync, commit, finish) writes under a fresh save id, syncs, then commits the manifest.
The data the replaced manifest owned is deleted after the commit, except what live sequences of this store still
read (an opened context grown and saved under its own name, or a background save reading it): the new manifest
inherits that, and a later save of the name drops it once unread (or `delete` does). The commit records the save
ids to delete under ctx/pending/delete/ in the same write (a delete, before taking the manifest), so
`collect_garbage` finds data a writer killed after its commit left; it also deletes what a killed save left before
its commit, once its writer is dead. kvstore/contexts/background_save.py runs the same steps beside decoding.
Full blocks of known token ids go under content keys (kvstore/contexts/save_blocks.py), shared by every save
naming them: through Redis, so a save there needs Config.model_id (ValueError); in LMDB too when the store has a
model_id, where kvstore/contexts/sweep.py deletes those no manifest names any more. Writes stream in batches
(values.write_all) while the next batch is built.
"""

from __future__ import annotations

import uuid
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable, Iterator

import lmdb
import torch

from kvstore.blocks.table import DROPPED, LayerTable
from kvstore.blocks.tierset import TierSet
from kvstore.contexts.opening import SavedContext, SavedReader
from kvstore.contexts.save_blocks import SaveBlocks
from kvstore.contexts.saved_format import DATA, MANIFEST, PENDING, RETIRED, SAVE_ID, VERSION, Values, check_name, \
    dead_here, layer_entry, own_keys, owned_ids, part_items, retired_name, retired_record, scores_item, \
    seal_manifest, token_bytes, value_digest, writer_record
from kvstore.contexts.sweep import SWEEP, sweep_blocks, sweep_needed
from tiers.base import Tier
from tiers.errors import CapacityError
from tiers.keys import chain_hashes
from tiers.saved_values import Item, LmdbValues, RedisValues
from tiers.ssd import SsdTier

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
        self.blocks = SaveBlocks(values, tiers)
        # whether data under a prefix is still read: by the saved tier, and by background saves (appended)
        self.reading: list[Callable[[bytes], bool]] = [tiers.saved.reads_under]

    def load(self, name: str) -> SavedContext:
        """The manifest and token ids of `name`; its layers read their summaries when handed their tensors."""
        return self.reader.load(name)

    # -- save ------------------------------------------------------------------------------
    def save(self, name: str, tables: list[LayerTable], token_ids: list[int] | None, codes: ReadLayerCodes) -> None:
        """Persist `tables` (and the sequence's token ids, if known) as `name`; codes(layer, lo, hi) gives the
        sketch codes of rows [lo, hi) (the table's, or those an opened sequence left in its save). Returns once
        the save is durable; on failure nothing of it stays under the name (content blocks it added may stay)."""
        self.check_save(name)
        self.collect_garbage()
        save_id = self.begin()
        try:
            manifest = self._write_data(save_id, tables, token_ids, codes)
            self.values.sync()  # every block and summary durable before the manifest names them
            done = self.commit(name, save_id, manifest)
        except BaseException as exc:
            error = self.abandon(name, save_id, exc)
            if error is exc:
                raise
            raise error from exc
        self.finish(name, done)
        if done.old is None and isinstance(self.values, LmdbValues):
            self.values.delete([SWEEP])  # nothing replaced: every block this save wrote is named
        self._sweep()

    def check_save(self, name: str) -> None:
        """ValueError for a name or a store (Redis without a model_id) a save cannot have."""
        check_name(name)
        self.reader.check_model_id()

    def begin(self) -> bytes:
        """A new save id, its writer recorded (ctx/pending/<id>: collect_garbage knows whose data it is)."""
        save_id = uuid.uuid4().hex.encode()
        self._may_orphan()  # content blocks this save writes are named by no manifest until it commits
        self.values.put([(PENDING + save_id, writer_record())])
        return save_id

    def commit(self, name: str, save_id: bytes, manifest: dict) -> Committed:
        """The manifest of `name` names this save (its data synced before): what the one it replaces owned and no
        live sequence of this store reads is recorded as retired in the same write (kept data is inherited)."""
        earlier = owned_ids(name, self.reader.manifest(name)) or []  # a damaged manifest names nothing
        inherits = self._still_read(earlier)
        manifest.update(name=name, root=self.root.hex(), inherits=inherits)
        old = self.values.commit(MANIFEST + name.encode(), seal_manifest(name, manifest), PENDING + save_id,
                                 self._retired(name, set(earlier) - set(inherits)))
        return Committed(old, earlier, inherits)

    def finish(self, name: str, done: Committed) -> None:
        """After the commit: the data of the replaced manifest goes (`old` is the manifest `commit` read, unless
        another process saved the name meanwhile)."""
        replaced = set(owned_ids(name, done.old) or []) - set(done.inherits)
        self._retire(name, replaced - set(done.earlier))
        self.values.sync()
        self._delete_data(replaced)

    def abandon(self, name: str, save_id: bytes, exc: BaseException, sweep: bool = True) -> BaseException:
        """A save that failed before its commit leaves nothing (its data, its writer's record; sweep: the content
        blocks it added, else ctx/sweep stays recorded); returns the error to raise."""
        if not self._committed(name, save_id):  # a commit whose reply was lost did land: keep its data
            self.values.delete_prefix(DATA + save_id + b"/")
            self.values.delete([PENDING + save_id])
            if sweep:
                with suppress(Exception):  # the save's own error is the one to report; ctx/sweep stays recorded
                    self._sweep()
        if isinstance(exc, lmdb.MapFullError):
            return CapacityError(f"saving {name!r}: the ssd tier's LMDB map (2 x ssd_bytes) is full")
        return exc

    def _still_read(self, save_ids: list[str]) -> list[str]:
        """Those of `save_ids` whose data live sequences of this store still read: blocks left in the saved
        tier, or sketch codes not loaded yet."""
        codes = set(self.reader.code_readers.values())
        return [s for s in save_ids if s in codes or any(reads(DATA + s.encode() + b"/") for reads in self.reading)]

    def _retire(self, name: str, save_ids: Iterable[str]) -> None:
        """Record that the data of `save_ids` goes once the manifest of `name` no longer owns it."""
        self.values.put(self._retired(name, save_ids))

    def _retired(self, name: str, save_ids: Iterable[str]) -> list[tuple[bytes, bytes]]:
        return [retired_record(RETIRED + s.encode(), name) for s in sorted(save_ids)]

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
        """Blocks, per-layer metadata and token ids under the save id, streamed in batches (values.write_all:
        the next batch is built while the last is written); returns the manifest's other fields."""
        data, layers, tokens = DATA + save_id + b"/", [], token_bytes(token_ids)
        self.blocks.counts = dict.fromkeys(self.blocks.counts, 0)
        self.values.write_all(self._batches(data, tables, self.chain(token_ids), codes, layers, tokens))
        return self.manifest_fields(save_id, layers, tokens)

    def chain(self, token_ids: list[int] | None) -> list[bytes]:
        """The chain hash of every full block of `token_ids` where blocks are content-keyed (a model_id)."""
        return chain_hashes(self.root, token_ids, self.block_tokens) if token_ids and self.reader.model_id else []

    def manifest_fields(self, save_id: bytes, layers: list[dict], tokens: bytes | None) -> dict:
        """The manifest of a save whose data is written, but its name, root and inherited data (`commit`)."""
        return {"version": VERSION, "save_id": save_id.decode(), "layers": layers,
                "geometry": [self.num_kv_heads, self.head_dim, self.block_tokens], "part_blocks": self.part_blocks,
                "tokens_xxh3": None if tokens is None else value_digest(DATA + save_id + b"/t", tokens)}

    def _batches(self, data: bytes, tables: list[LayerTable], chain: list[bytes], codes: ReadLayerCodes,
                 layers: list[dict], tokens: bytes | None) -> Iterator[list[Item]]:
        """The save's write batches, layer by layer: its blocks (SaveBlocks.items), then its metadata, whose
        manifest entry is appended to `layers`; the token ids last."""
        for layer, table in enumerate(tables):
            keyed = min(len(chain), table.num_tokens // self.block_tokens)
            own, formats = own_keys(data, layer, keyed, table.num_blocks), [0] * keyed  # dropped: never read
            live = [i for i, b in enumerate(table.block_ids) if b != DROPPED]
            for lo in range(0, len(live), self.blocks.batch_blocks):
                yield self.blocks.items(layer, table, live[lo: lo + self.blocks.batch_blocks], chain[:keyed], own,
                                        formats)
            items, entry = self._meta(data, layer, table, formats, partial(codes, layer))
            layers.append(entry)
            yield items
        if tokens is not None:
            yield [(data + b"t", tokens, False)]

    def _meta(self, data: bytes, layer: int, table: LayerTable, formats: list[int],
              codes: Callable[[int, int], torch.Tensor]) -> tuple[list[Item], dict]:
        """The layer's summaries, H2O scores and sketch codes to write, and its manifest entry."""
        n = table.num_blocks
        items = [scores_item(data, layer, table.h2o_scores[:, :n].cpu().contiguous().numpy().tobytes() if n else b"")]
        for part, lo in enumerate(range(0, n, self.part_blocks)):
            hi = min(n, lo + self.part_blocks)
            items += part_items(data, layer, part, _bytes(table.summaries[lo:hi]), _bytes(codes(lo, hi)))
        dropped = [i for i, b in enumerate(table.block_ids) if b == DROPPED]
        return [(k, v, False) for k, v in items], layer_entry(table.num_tokens, n, formats, dropped,
                                                              [value_digest(k, v) for k, v in items])

    # -- listing and deleting --------------------------------------------------------------
    def names(self) -> list[str]:
        return self.reader.names()

    def delete(self, name: str) -> None:
        """The manifest and the data it owns; content-keyed blocks stay for other saves naming them. What it owns
        is recorded as retired first: a delete killed part way leaves its data to collect_garbage."""
        check_name(name)
        earlier = owned_ids(name, self.reader.manifest(name)) or []
        self._retire(name, earlier)
        self._may_orphan()
        raw = self.values.pop(MANIFEST + name.encode())  # one step: a save of the name meanwhile is kept whole
        if raw is None:
            raise KeyError(f"no saved context named {name!r}")
        owned = owned_ids(name, raw) or []  # a damaged manifest names nothing: its data stays
        self._retire(name, set(owned) - set(earlier))
        self._delete_data(owned)
        self._sweep()

    def _may_orphan(self) -> None:
        """LMDB: record that content-keyed blocks may lose their last manifest (kvstore/contexts/sweep.py)."""
        if isinstance(self.values, LmdbValues):
            sweep_needed(self.values)

    def _sweep(self) -> int:
        """LMDB: the content-keyed blocks no manifest names and no sequence of this store reads, deleted."""
        if not isinstance(self.values, LmdbValues):
            return 0
        return sweep_blocks(self.values, self.reader, self.tiers.saved.key_of.values(), self._other_writers)

    def _other_writers(self) -> bool:
        """Whether a save is in progress that is not known dead (its blocks are named by no manifest yet)."""
        keys = [k for k in self.values.keys(PENDING) if not k.startswith(RETIRED)]
        return not all(dead_here(info) for info in self.values.get(keys))

    def collect_garbage(self) -> int:
        """Delete saved data that no manifest owns and no live writer writes; returns how many saves' data went:
        that of saves whose writer died before its commit (this host's dead pids only), and that of replaced or
        deleted saves whose writer stopped before deleting it (retired). Keeps whatever a manifest that cannot
        be read (damaged) might own."""
        keys = self.values.keys(PENDING)  # writers and retired data: one scan
        records = dict(zip(keys, self.values.get(keys)))
        retired = {k: v for k, v in records.items() if k.startswith(RETIRED)}
        writers = {k: v for k, v in records.items() if k not in retired}
        if any(dead_here(info) for info in writers.values()) or retired:
            self._may_orphan()  # a save killed before its commit, data a re-save or delete left
        freed = self._collect_dead_writers(writers) + self._collect_retired(retired)
        self._sweep()
        return freed

    def _collect_dead_writers(self, writers: dict[bytes, bytes | None]) -> int:
        dead = [k[len(PENDING):] for k, info in writers.items() if dead_here(info)]
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
            name = retired_name(key, raw)
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


@dataclass(frozen=True, slots=True)
class Committed:
    """What a commit replaced: the manifest it overwrote (None: none), the save ids the manifest read before the
    commit owned, and those of them the new one inherits (live sequences still read them)."""

    old: bytes | None
    earlier: list[str]
    inherits: list[str]
