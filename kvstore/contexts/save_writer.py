"""The writer thread of a background save (kvstore/contexts/background_save.py).

The decode thread hands it Chunks: blocks copied out of the tiers (SaveBlocks.read's groups) or a layer's summary
and sketch code rows, and at last an end marker. The writer encodes them (SaveBlocks.encode: content keys checked,
zstd, checksums, saved-tier values read by key), writes them in batches (values.write_all: one LMDB transaction or
pipelined Redis SETs a batch; the chunks waiting when one is taken go in the same batch), writes the token ids and
syncs. It then asks the decode thread for the commit (which reads the live sequences' state: SavedContexts.commit)
and waits for it; after the commit it deletes what the commit replaced (SavedContexts.finish). A failure, or a stop
before the commit, deletes what it wrote (SavedContexts.abandon); the sweep of content-keyed blocks stays recorded
for the store's next save, delete or collect_garbage, which run on its thread.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from kvstore.blocks.table import LayerTable
from kvstore.contexts.save_blocks import BATCH_BYTES, Group
from kvstore.contexts.saved_format import DATA, layer_entry, own_keys, part_items, scores_item, token_bytes, \
    value_digest
from kvstore.contexts.saving import Committed, SavedContexts
from tiers.saved_values import Item

READING, WRITING, COMMIT, COMMITTED, ENDED = range(5)  # a save's states, in order (COMMIT: the writer waits)


@dataclass(slots=True)
class Chunk:
    """What the decode thread hands the writer: blocks (table indices and their groups) or summary and code rows."""

    layer: int  # -1: the end
    indices: Sequence[int] = ()
    groups: list[Group] | None = None
    summaries: torch.Tensor | None = None  # fp16 [r, 2, H, D] on the host
    codes: torch.Tensor | None = None  # uint8 [r, H, 2, B, D/4] on the host
    ready: torch.cuda.Event | None = None  # after the copies of summaries (CUDA)
    last: bool = False  # the layer's last rows before its tail
    pumped: bool = False  # counts against the pump's bound on chunks waiting here


@dataclass(slots=True)
class LayerCopy:
    """One layer as the call found it, and what the writer has made of it."""

    table: LayerTable  # the pump reads rows below the tail from it (they never change)
    num_tokens: int
    block_ids: list[int]
    live: Sequence[int]  # indices to pump (not dropped, the tail aside), ascending
    dropped: list[int]
    scores: torch.Tensor | None = None  # fp32 [H, n] on the host
    tail: tuple[torch.Tensor, torch.Tensor] | None = None  # the tail's summary and code rows on the host
    ready: torch.cuda.Event | None = None  # after the copies of scores and tail rows (CUDA)
    chain: list[bytes] = field(default_factory=list)  # the writer's: chain hashes of the content-keyed blocks,
    formats: list[int] = field(default_factory=list)  # their formats, the own keys of the rest,
    own: list[bytes] = field(default_factory=list)
    rows: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # rows of the part not yet written
    digests: list[int] = field(default_factory=list)  # of its scores, then of each part's summaries and codes

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class SaveWriter:
    """Writes the chunks of one save under `save_id` (module docstring); `error` says how it ended, if it failed."""

    def __init__(self, saved: SavedContexts, name: str, save_id: bytes, layers: list[LayerCopy],
                 token_ids: list[int] | None, counts: dict[str, int]) -> None:
        self.saved, self.name, self.save_id, self.layers, self.counts = saved, name, save_id, layers, counts
        self.state, self.error = READING, None
        self._token_ids = token_ids
        self._queue: queue.Queue = queue.Queue()
        self._lock, self.outstanding = threading.Lock(), 0  # pumped chunks not taken yet
        self.stop, self.wakeup, self.ended = threading.Event(), threading.Event(), threading.Event()
        self._committed = threading.Event()
        self._result: Committed | BaseException | None = None
        self.manifest: dict | None = None
        self.thread = threading.Thread(target=self._run, name="kvtier-background-save", daemon=True)

    # -- the decode thread ------------------------------------------------------------------
    def put(self, chunk: Chunk) -> None:
        if chunk.pumped:
            with self._lock:
                self.outstanding += 1
        self._queue.put(chunk)

    def committed(self, result: Committed | BaseException) -> None:
        """The decode thread's commit (or its error)."""
        self._result, self.state = result, COMMITTED
        self._committed.set()

    def fail(self, error: BaseException) -> None:
        """End the save before its commit with `error` (nothing of it stays)."""
        if self.state < COMMITTED:
            self.error = error
            self.stop.set()

    # -- the writer thread ------------------------------------------------------------------
    def _run(self) -> None:
        saved, committed = self.saved, None
        try:
            chain, data, tokens = saved.chain(self._token_ids), DATA + self.save_id + b"/", token_bytes(self._token_ids)
            for layer, c in enumerate(self.layers):
                keyed = min(len(chain), c.num_tokens // saved.block_tokens)
                c.chain, c.formats, c.own = chain[:keyed], [0] * keyed, own_keys(data, layer, keyed, c.num_blocks)
            saved.values.write_all(self._batches(data, tokens))
            entries = [layer_entry(c.num_tokens, c.num_blocks, c.formats, c.dropped, c.digests) for c in self.layers]
            self.manifest = saved.manifest_fields(self.save_id, entries, tokens)
            saved.values.sync()  # every block and summary durable before the manifest names them
            self.state = COMMIT  # the decode thread's next pump commits
            while not self._committed.wait(0.05):
                if self.stop.is_set():
                    raise self.error
            if isinstance(self._result, BaseException):
                raise self._result
            committed = self._result
            saved.finish(self.name, committed)
        except BaseException as exc:  # noqa: BLE001 -- SaveJob.wait raises it
            error = exc
            if committed is None:
                try:
                    error = saved.abandon(self.name, self.save_id, exc, sweep=False)
                except Exception:  # noqa: BLE001 -- the save's own error is the one to report
                    pass
                if error is not exc:
                    error.__cause__ = exc
            self.error = error
        finally:
            self.state = ENDED
            self.ended.set()
            self.wakeup.set()

    def _batches(self, data: bytes, tokens: bytes | None) -> Iterator[list[Item]]:
        """The write batches: a chunk's items, merged with those of the chunks already waiting behind it, up to
        BATCH_BYTES (a synchronous save's batch): when the writes fall behind the pumps, the chunks that piled up go
        in fewer, larger transactions (each LMDB commit syncs), and the token ids with the last."""
        batch, size = [], 0
        while (chunk := self._take(wait=not batch)) is None or chunk.layer >= 0:
            if chunk is not None:
                c = self.layers[chunk.layer]
                if chunk.groups is not None:
                    items = self.saved.blocks.encode(chunk.layer, chunk.indices, chunk.groups, c.chain, c.own,
                                                     c.formats, self.counts)
                else:
                    items = self._meta(data, chunk, c)
                batch += items
                size += sum(len(v) for _, v, _ in items)
            if chunk is None or size >= BATCH_BYTES:  # nothing waits (the batch goes now), or the batch is full
                yield batch
                batch, size = [], 0
        if tokens is not None:
            batch.append((data + b"t", tokens, False))
        if batch:
            yield batch

    def _take(self, wait: bool = True) -> Chunk | None:
        """The next chunk; without `wait`, None if none is queued."""
        while True:
            if self.stop.is_set():
                raise self.error
            try:
                chunk = self._queue.get(timeout=0.05) if wait else self._queue.get_nowait()
            except queue.Empty:
                if not wait:
                    return None
                continue
            if chunk.pumped:
                with self._lock:
                    self.outstanding -= 1
                self.wakeup.set()
            return chunk

    def _meta(self, data: bytes, chunk: Chunk, c: LayerCopy) -> list[Item]:
        """Parts of the layer's summaries and sketch codes once their rows are in (the tail's last); the layer's
        H2O scores with its last rows."""
        for event in (chunk.ready, c.ready if chunk.last else None):
            if event is not None:
                event.synchronize()
        if chunk.summaries is not None:
            c.rows.append((chunk.summaries, chunk.codes))
        if chunk.last and c.tail is not None:
            c.rows.append(c.tail)
        p, items = self.saved.part_blocks, []
        have = sum(len(m) for m, _ in c.rows)
        if have >= p or (chunk.last and have):
            m, k = torch.cat([m for m, _ in c.rows]), torch.cat([k for _, k in c.rows])
            while len(m) >= p or (chunk.last and len(m)):
                part = part_items(data, chunk.layer, len(c.digests) // 2, _bytes(m[:p]), _bytes(k[:p]))
                c.digests += [value_digest(key, v) for key, v in part]
                items += part
                m, k = m[p:], k[p:]
            c.rows = [(m, k)] if len(m) else []
        if chunk.last:
            scores = scores_item(data, chunk.layer, b"" if c.scores is None else _bytes(c.scores))
            c.digests.insert(0, value_digest(*scores))
            items.insert(0, scores)
        return [(key, v, False) for key, v in items]


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()
