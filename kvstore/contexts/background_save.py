"""Background save: `store.save(seq, name, background=True)` returns a SaveJob at once, and the save completes while
tokens decode. What is saved is the sequence as it was at the call.

The tier set and the tables belong to the decode thread, so every read of them happens there, a bounded amount at a
time; a writer thread does the rest (zstd and checksums, the exists checks of content keys, the writes, the sync):

- At the call: each layer's tail block (appends write it in place), its summary and sketch code rows, its H2O scores
  [H, n] and its block ids are copied, and the token ids; the writer's record (ctx/pending/<save id>) is written.
- `pump` (KVStore.pump_saves; engine_adapter.Decoder calls it before every token) copies the next blocks of the
  save, layer by layer, into host buffers, then the layer's summary and code rows: at most `pump_blocks` blocks a
  call (32 MiB of fp16 blocks by default), or as many blocks' bytes of rows (`rows_per_block` rows a block, 6 at
  llama3-8b's geometry, so a layer's rows take that many times fewer pumps than its blocks), and none while QUEUED
  chunks wait for the writer. On CUDA a copy is a gather queued before an asynchronous copy into pinned memory,
  which the writer waits for; saved-tier blocks are not read at all (the writer reads their values by key, and the
  saved contexts keep those data while it may).
- Full blocks never change, but their tier may, and with it their format (hot fp16 -> warm int8, cpu fp16 -> warm
  on promotion). So a block of the save that leaves its tier (a move, an H2O drop) before the pump reached it is
  copied as it was, in that move, on the decode thread (TierSet.leaving), unless the move keeps its format (warm
  int8 -> cpu int8): the save holds every block as stored at the call, and opens to what a save at the call opens
  to. That copy costs what the move costs again, on top of the pump's bound; its host memory waits for the writer.
- The writer (kvstore/contexts/save_writer.py) syncs the data, then the next pump commits the manifest
  (SavedContexts.commit: what it replaces is retired in the same write, live readers' data inherited: a small
  read and one write). The writer then deletes what the commit replaced.

Freeing the sequence before the pump has read all of it aborts the save, as closing the store does before its
commit: SaveJob.wait raises SaveAborted, the save's data and writer record are deleted, and an earlier save of the
name stays as it was. A save that has read everything finishes whatever happens to its sequence. A failing write (a
full LMDB map: CapacityError; Redis gone) or read (IntegrityError, BlockMissingError) is raised by wait, and leaves
nothing under the name either. The pump never raises for a save.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import torch

from kvstore.blocks.table import DROPPED, LayerTable
from kvstore.blocks.tierset import CPU_TIER, HOT_TIER, WARM_TIER, TierSet
from kvstore.contexts.save_writer import COMMIT, COMMITTED, READING, WRITING, Chunk, LayerCopy, SaveWriter
from kvstore.contexts.saved_format import DATA
from kvstore.contexts.saving import ReadLayerCodes, SavedContexts
from tiers.errors import BlockMissingError

QUEUED = 4  # pumped chunks waiting for the writer, at most: host memory (QUEUED x pump_blocks blocks)
PUMP_BYTES = 32 << 20  # fp16 block bytes a pump copies at most: ~0.6 ms of pinned copy on an H200, ~5 ms of memcpy


class SaveAborted(RuntimeError):
    """A background save ended before its commit (its sequence freed, the store closed): nothing was saved."""


class SaveJob:
    """A save on its way (module docstring): done(), wait(timeout), progress."""

    def __init__(self, saves: BackgroundSaves, saved: SavedContexts, seq: int, name: str, tables: list[LayerTable],
                 token_ids: list[int] | None, codes: ReadLayerCodes) -> None:
        self.seq, self.name, self._saves, self._saved, self._codes = seq, name, saves, saved, codes
        self._owner = threading.get_ident()  # the store's thread: wait() there pumps
        self._layer = self._pos = self._row = 0  # the pump's place: layer, then its next block or summary row
        self._captured: set[tuple[int, int]] = set()  # (layer, index) of blocks copied by moves
        self._reads: set[bytes] = set()  # data prefixes of saved values queued for the writer to read by key
        self._chunks: list[Chunk] = []  # the tails, queued once the writer exists
        self.counts = {"blocks_read": 0, "blocks_copied_by_moves": 0, "blocks_written": 0, "bytes_written": 0,
                       "blocks_shared": 0}
        layers = [self._copy(layer, table) for layer, table in enumerate(tables)]
        self.num_blocks = sum(c.num_blocks - len(c.dropped) for c in layers)
        self.writer = SaveWriter(saved, name, saved.begin(), layers, token_ids, self.counts)  # begin: its record
        for chunk in self._chunks:
            self.writer.put(chunk)
        self._chunks.clear()
        self.writer.thread.start()

    def _copy(self, layer: int, table: LayerTable) -> LayerCopy:
        """The layer's block ids, tail block, tail rows and H2O scores, copied now."""
        n, ids = table.num_blocks, list(table.block_ids)
        dropped = [i for i, b in enumerate(ids) if b == DROPPED] if table.num_dropped else []
        live = range(max(0, n - 1)) if not dropped else [i for i in range(n - 1) if ids[i] != DROPPED]
        out = LayerCopy(table, table.num_tokens, ids, live, dropped)
        if n:
            out.scores = _host(table.h2o_scores[:, :n])
            out.tail = (_host(table.summaries[n - 1:n]), self._codes(layer, n - 1, n))
            out.ready = _event(table.summaries)
            self._chunks.append(Chunk(layer, [n - 1], self._saved.blocks.read([ids[n - 1]])))
            self.counts["blocks_read"] += 1
        return out

    # -- what users call --------------------------------------------------------------------
    def done(self) -> bool:
        """Whether the save has ended (durable, or failed)."""
        return self.writer.ended.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Until the save is durable; raises what ended it otherwise (SaveAborted, CapacityError, ...), and
        TimeoutError if it still runs after `timeout` seconds. On the store's thread it pumps the save itself
        (as fast as the writer takes chunks); elsewhere the store's thread must keep pumping."""
        deadline, writer = None if timeout is None else time.monotonic() + timeout, self.writer
        while not writer.ended.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"background save of {self.name!r} still runs after {timeout} s")
            if threading.get_ident() == self._owner:
                writer.wakeup.clear()
                self._saves.pump(1 << 62)
                writer.wakeup.wait(0.05 if left is None else min(left, 0.05))
            else:
                writer.ended.wait(0.1 if left is None else min(left, 0.1))
        if writer.error is not None:
            raise writer.error

    @property
    def progress(self) -> dict:
        """state (reading, writing, committing: waiting for a pump to commit, committed: deleting what it replaced,
        done or failed); blocks (of the save); blocks_read (out of the tiers so far: at the call, by pumps and by
        moves, blocks_copied_by_moves of them); blocks_written, bytes_written, blocks_shared (content key held)."""
        writer = self.writer
        state = ("failed" if writer.error else "done") if writer.ended.is_set() else \
            ("reading", "writing", "committing", "committed", "ending")[writer.state]
        return {"state": state, "blocks": self.num_blocks, **self.counts}

    # -- the decode thread ------------------------------------------------------------------
    def pump(self, budget: int) -> int:
        """Copy up to `budget` blocks (rows by their bytes) for the writer (module docstring), or commit once it waits
        for that."""
        writer, moved = self.writer, 0
        if writer.state == COMMIT:
            try:
                writer.committed(self._saved.commit(self.name, writer.save_id, writer.manifest))
            except Exception as exc:  # noqa: BLE001 -- the writer cleans up and wait() raises it
                writer.committed(exc)
            self._saves.release(self)
        while writer.state == READING and moved < budget and writer.outstanding < QUEUED:
            moved += self._pump_one(budget - moved)
        return moved

    def _pump_one(self, limit: int) -> int:
        """The next blocks of the layer at the pump's place, or its next summary and code rows; after the last
        layer, the end."""
        layer, layers = self._layer, self.writer.layers
        if layer == len(layers):
            self.writer.state = WRITING
            self.writer.put(Chunk(-1))  # the writer then writes the token ids, syncs, and asks for the commit
            return 0
        c = layers[layer]
        if self._pos < len(c.live):
            indices = []
            while self._pos < len(c.live) and len(indices) < limit:
                if (layer, c.live[self._pos]) not in self._captured:
                    indices.append(c.live[self._pos])
                self._pos += 1
            ids = [c.block_ids[i] for i in indices]
            gone = [i for i, b in zip(indices, ids) if b not in self._saves.tiers.blocks.tier_of]
            if gone:  # dropped by H2O while another sequence held it, then freed by that one
                raise BlockMissingError(f"layer {layer}'s blocks {gone[:8]} were freed before the save read them")
            if indices:
                self._hand(Chunk(layer, indices, self._saved.blocks.read(ids), pumped=True))
            return len(indices)
        per_block = self._saves.rows_per_block  # rows count by their bytes: per_block rows a block of the limit
        lo = self._row  # the tail's row was copied at the call
        hi = min(c.num_blocks - 1, lo + limit * per_block)
        chunk = Chunk(layer, pumped=True, last=hi >= c.num_blocks - 1)
        if hi > lo:
            chunk.summaries, chunk.codes = _host(c.table.summaries[lo:hi]), self._codes(layer, lo, hi)
            chunk.ready = _event(c.table.summaries)
        self.writer.put(chunk)
        self._layer, self._pos, self._row = (layer + 1, 0, 0) if chunk.last else (layer, self._pos, hi)
        return -(-max(0, hi - lo) // per_block)  # in blocks' bytes

    def _hand(self, chunk: Chunk) -> None:
        """Blocks read for the writer; the data of saved values it reads by key stay meanwhile (reads_under)."""
        self._reads.update(k[:len(DATA) + 33] for g in chunk.groups if g.keys for k in g.keys if k.startswith(DATA))
        self.counts["blocks_read"] += len(chunk.indices)
        self.writer.put(chunk)

    def leaving(self, ids: Sequence[int], tier: int) -> None:
        """TierSet.leaving: blocks `ids` leave `tier`; copy those the save has not read yet, as they are there."""
        registry, formats, wanted = self._saves.tiers.blocks, self._saves.formats, {}
        for row, block_id in enumerate(ids):
            dst = registry.tier_of.get(block_id)  # where a move put it; `tier` still for a block being freed
            if dst != tier and formats.get(tier) is not None and formats.get(tier) == formats.get(dst):
                continue  # it is held there as it was here: the pump reads the same bytes there
            for seq, layer, i in registry.holders_of(block_id):
                if seq == self.seq and self._needs(layer, i, block_id):
                    wanted.setdefault(layer, []).append((row, i))
        for layer, found in wanted.items():
            group = self._saved.blocks.read_from(tier, [ids[r] for r, _ in found], list(range(len(found))))
            self._hand(Chunk(layer, [i for _, i in found], [group]))
            self._captured.update((layer, i) for _, i in found)
            self.counts["blocks_copied_by_moves"] += len(found)

    def _needs(self, layer: int, index: int, block_id: int) -> bool:
        """Whether block `index` of `layer` (`block_id`) is in the save and not copied yet (the pump takes each
        layer's blocks in ascending order)."""
        layers = self.writer.layers
        if self.writer.state != READING or not self._layer <= layer < len(layers) or (layer, index) in self._captured:
            return False
        c = layers[layer]
        if index >= c.num_blocks - 1 or c.block_ids[index] != block_id:
            return False
        return layer > self._layer or (self._pos < len(c.live) and index >= c.live[self._pos])

    def fail(self, error: BaseException) -> None:
        """End the save before its commit (nothing of it stays); one that has committed finishes."""
        self.writer.fail(error)
        if self.writer.state < COMMITTED:
            self._saves.release(self)


class BackgroundSaves:
    """The store's background saves: started by save(..., background=True), pumped between tokens, aborted by free
    (while they read their sequence) and by close (before their commit)."""

    def __init__(self, tiers: TierSet) -> None:
        self.tiers = tiers
        block_bytes, t = tiers.layout.fp16_bytes, tiers.holders.tensors
        self.pump_blocks = max(1, PUMP_BYTES // block_bytes)  # per pump call, at most
        # a block's rows (LayerTable): summaries fp16 [2, H, D], sketch codes uint8 [H, 2, B, code_bytes]
        row_bytes = 2 * t.num_kv_heads * t.head_dim * 2 + t.num_kv_heads * 2 * t.block_tokens * t.code_bytes
        self.rows_per_block = max(1, block_bytes // row_bytes)  # rows a pump copies per block of its budget
        self.formats = {HOT_TIER: "float16", WARM_TIER: tiers.warm.format, CPU_TIER: tiers.cpu.dtype}  # as they hold
        self.jobs: list[SaveJob] = []  # saves still reading the tiers or waiting for their commit
        self._started: list[SaveJob] = []  # every save not known to have ended: close() waits for its writer

    def start(self, saved: SavedContexts, seq: int, name: str, tables: list[LayerTable], token_ids: list[int] | None,
              codes: ReadLayerCodes) -> SaveJob:
        saved.check_save(name)
        job = SaveJob(self, saved, seq, name, tables, token_ids, codes)
        if not self.jobs:
            self.tiers.leaving.append(self._leaving)
        if self.reads_under not in saved.reading:
            saved.reading.append(self.reads_under)
        self.jobs.append(job)
        self._started = [j for j in self._started if not j.done()] + [job]
        return job

    def pump(self, max_blocks: int | None = None) -> int:
        """SaveJob.pump of every save, `max_blocks` (default pump_blocks) shared among them; returns the blocks
        copied, rows counted in blocks' bytes (rows_per_block a block). A save whose writer failed is forgotten
        here (its wait() raises)."""
        budget, moved = self.pump_blocks if max_blocks is None else max_blocks, 0
        for job in list(self.jobs):
            if job.writer.error is not None:
                self.release(job)
                continue
            try:
                moved += job.pump(budget - moved)
            except Exception as exc:  # noqa: BLE001 -- a failed read fails the save (wait() raises it), not the token
                job.fail(exc)
        return moved

    def reads_under(self, prefix: bytes) -> bool:
        """Whether a save may still read saved values under `prefix` (its writer reads them by key)."""
        return any(prefix in job._reads for job in self.jobs if job.writer.state < COMMITTED)

    def stop(self, seq: int) -> None:
        """Sequence `seq` is being freed: abort the saves still reading it."""
        for job in [j for j in self.jobs if j.seq == seq and j.writer.state == READING]:
            job.fail(SaveAborted(f"background save of {job.name!r} aborted: sequence {seq} was freed before the "
                                 "save had read it; nothing was saved under the name (an earlier save is as it was)"))

    def release(self, job: SaveJob) -> None:
        """`job` no longer reads the tiers."""
        if job in self.jobs:
            self.jobs.remove(job)
        if not self.jobs and self._leaving in self.tiers.leaving:
            self.tiers.leaving.remove(self._leaving)

    def _leaving(self, ids: Sequence[int], tier: int) -> None:
        for job in list(self.jobs):
            try:
                job.leaving(ids, tier)
            except Exception as exc:  # noqa: BLE001 -- a damaged block fails the save, never the move
                job.fail(exc)

    def close(self) -> None:
        """Abort the saves that have not committed; wait for every writer (before the values store closes)."""
        for job in list(self.jobs):
            job.fail(SaveAborted(f"background save of {job.name!r} aborted: the store was closed before its commit; "
                                 "nothing was saved under the name (an earlier save is as it was)"))
        for job in self._started:
            job.writer.thread.join()


def _host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t` (from a GPU queued into pinned memory: read it after _event's event)."""
    return t.to("cpu", non_blocking=True) if t.device.type == "cuda" else t.clone()


def _event(t: torch.Tensor | None) -> torch.cuda.Event | None:
    """An event after the copies queued so far, where `t` lives on a GPU."""
    if t is None or t.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event
