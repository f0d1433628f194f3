"""Background load of opened saved contexts: a thread reads a sequence's blocks from its save while its tokens
decode, and the decode thread puts what was read into the tiers between tokens.

`KVStore.open(name, background_load=True)` starts a SequenceLoad. Its thread does the slow part of a load
(tiers/saved.py `read_as_stored`: each value read where it lies, its checksum verified, decompressed into one
host batch of LOAD_BATCH blocks), newest blocks first, the layers in turn, and hands the batches over a queue
at most QUEUED deep. It touches nothing of the store but the values store and the saved tier's keys (one dict
read per block). `place` runs on the decode thread (KVStore.place_loaded; engine_adapter.Decoder calls it
before every token) and puts the batches read so far into the tiers their positions belong in (the hot and
warm windows, else cpu), into free room only, as store.load does; where a window's GPU tier has no room, into
the cpu tier, as cooling would (kvstore/blocks/from_saved.py). A block that left the save meanwhile (kept by
the eager path, moved by store.load) is skipped. No lock is shared with the decode path, and one call places
at most QUEUED batches: a bounded pause between two tokens, also for the other sequences of a batch. Once every
block of the sequence is on the GPU or in the cpu tier, the captured decode step serves it
(kvstore/decode/step.py); until then its tokens take the eager path.

A read that fails (a damaged or deleted saved value) ends the load and raises from the next `place` (nothing
of that batch moved); what does not fit stays in the save (read when selected; store.load moves it once there
is room). Freeing the sequence or closing the store stops the thread.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch

from kvstore.blocks.from_saved import LOAD_BATCH, keep_read
from kvstore.blocks.table import LayerTable
from kvstore.blocks.tierset import SAVED_TIER, TierSet
from tiers.stored import StoredBlocks

QUEUED = 4  # batches read ahead of `place`: host memory (~0.5 GiB of llama3-8b int8 blocks) and the most one
# place call puts in


@dataclass(slots=True)
class Batch:
    """Blocks of one layer's table to read together: their positions in the table and ids."""

    table: LayerTable
    indices: list[int]
    ids: list[int]


class SequenceLoad:
    """One opened sequence's saved blocks, read on a thread and placed by the decode thread (module docstring)."""

    def __init__(self, tiers: TierSet, tables: list[LayerTable], batch_blocks: int = LOAD_BATCH) -> None:
        self.tiers = tiers
        self.batches = plan_batches(tables, batch_blocks)
        self.done = not self.batches  # every batch handed over and placed, or the load failed
        self._ready: queue.Queue = queue.Queue(maxsize=QUEUED)  # (Batch, StoredBlocks), then None; or an exception
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="kvtier-saved-load", daemon=True)
        if self.batches:
            self._thread.start()

    # -- the reading thread -----------------------------------------------------------------------
    def _read(self) -> None:
        saved = self.tiers.saved
        for batch in self.batches:
            keys = [saved.key(i) for i in batch.ids]  # None: no longer in the save (promoted, loaded)
            rows = [r for r, k in enumerate(keys) if k is not None]
            batch = Batch(batch.table, [batch.indices[r] for r in rows], [batch.ids[r] for r in rows])
            try:
                blocks = saved.read_as_stored(batch.ids, [keys[r] for r in rows], "cpu")
            except Exception as exc:  # noqa: BLE001 -- raised on the decode thread by `place`
                self._hand(exc)
                return
            if not self._hand((batch, blocks)):
                return
        self._hand(None)

    def _hand(self, item: object) -> bool:
        """Queue `item` for `place`, waiting while the queue is full; False once the load was stopped."""
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    # -- the decode thread ------------------------------------------------------------------------
    def place(self) -> int:
        """Put the batches read so far into their tiers (module docstring); returns how many blocks moved. Raises
        what a read raised (IntegrityError, BlockMissingError), once: the load has ended then."""
        moved = 0
        for _ in range(QUEUED):  # what the queue held: the thread may refill it meanwhile
            if self.done:
                break
            try:
                item = self._ready.get_nowait()
            except queue.Empty:
                break
            if item is None or isinstance(item, BaseException):
                self.done = True
                if item is not None:
                    raise item
                break
            moved += self._put(*item)
        return moved

    def _put(self, batch: Batch, blocks: StoredBlocks) -> int:
        """The blocks of `batch` still in the save into the tier of their position now, as far as it has room."""
        return keep_read(self.tiers, batch.table, batch.indices, batch.ids, blocks)

    def stop(self) -> None:
        """End the thread (waits for a read in progress: the values store stays open until it returns)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.done = True


def plan_batches(tables: list[LayerTable], batch_blocks: int) -> list[Batch]:
    """The tables' blocks in the saved tier, in batches of at most batch_blocks of one layer: newest first, the
    layers in turn (every layer's recent blocks, which decode selects most, come first)."""
    per_layer = []
    for table in tables:
        n = table.num_blocks
        indices = torch.nonzero(table.tier_map[:n] == SAVED_TIER).flatten().tolist()[::-1] if n else []  # one sync
        per_layer.append([Batch(table, indices[lo: lo + batch_blocks],
                                [table.block_ids[i] for i in indices[lo: lo + batch_blocks]])
                          for lo in range(0, len(indices), batch_blocks)])
    rounds = max((len(b) for b in per_layer), default=0)
    return [layer[r] for r in range(rounds) for layer in per_layer if r < len(layer)]


class BackgroundLoads:
    """The store's background loads, by sequence: started at open, placed between tokens, stopped at free."""

    def __init__(self, tiers: TierSet, batch_blocks: int = LOAD_BATCH) -> None:
        self.tiers, self.batch_blocks = tiers, batch_blocks
        self.loads: dict[int, SequenceLoad] = {}

    def start(self, seq: int, tables: list[LayerTable]) -> None:
        load = SequenceLoad(self.tiers, tables, self.batch_blocks)
        if not load.done:
            self.loads[seq] = load

    def loading(self, seq: int) -> bool:
        """Whether a background load of `seq` is still running (read or not yet placed)."""
        return seq in self.loads

    def place(self) -> int:
        """SequenceLoad.place of every running load; a finished one is forgotten. Returns blocks moved."""
        moved = 0
        for seq, load in list(self.loads.items()):
            try:
                moved += load.place()
            finally:
                if load.done:
                    self.stop(seq)
        return moved

    def stop(self, seq: int) -> None:
        load = self.loads.pop(seq, None)
        if load is not None:
            load.stop()

    def close(self) -> None:
        for seq in list(self.loads):
            self.stop(seq)

