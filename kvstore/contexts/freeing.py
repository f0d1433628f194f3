"""Freeing a sequence's blocks in bounded batches, so that a finished long context does not stall every other
sequence's next token.

Letting go of a block is host bookkeeping per table entry (its holders, its tier's slot, its content key): a
128K-token sequence of the llama3-8b geometry holds 32 x 2,048 entries at 64-token blocks, a few hundred ms of
Python on the decode thread. `KVStore.free(seq, background=True)` makes the sequence unknown at once (every
later call naming it raises KeyError) and queues its tables here; `release` (KVStore.release_freed;
engine_adapter.Decoder calls it before every token) lets go of at most `max_blocks` entries a call, from the
newest entry of the last layer back, truncating each table as it goes, so what is left of a table is always
a consistent shorter table (its counts and maps what the registry says). A queued table stays in the store's
tables dict (the holders of its blocks are looked up there, and another sequence may share them) until its
last entry is gone.
"""

from __future__ import annotations

from kvstore.blocks.table import DROPPED, LayerTable
from kvstore.blocks.tierset import TierSet

RELEASE_BATCH = 1024  # table entries let go of per call before a token (BENCHMARKS.md, Serving many sequences)


class PendingFrees:
    def __init__(self, tables: dict[int, list[LayerTable]], tiers: TierSet, block_tokens: int) -> None:
        self.tables, self.tiers, self.block_tokens = tables, tiers, block_tokens
        self.queued: dict[int, None] = {}  # sequences freed in the background, oldest first

    def __contains__(self, seq: int) -> bool:
        return seq in self.queued

    def add(self, seq: int) -> None:
        self.queued[seq] = None

    def entries(self) -> int:
        """Table entries still to let go of."""
        return sum(t.num_blocks for seq in self.queued for t in self.tables[seq])

    def release(self, max_blocks: int | None = None, seq: int | None = None) -> int:
        """Let go of up to `max_blocks` entries (None: all) of the queued sequences, oldest sequence first (or of
        `seq` alone); a sequence whose tables are empty leaves the tables dict. Returns the entries let go of."""
        released = 0
        for s in [seq] if seq is not None else list(self.queued):
            layers = self.tables[s]
            for layer in range(len(layers) - 1, -1, -1):
                released += self._release_tail(s, layer, layers[layer], None if max_blocks is None
                                               else max_blocks - released)
                if layers[layer].num_blocks:
                    return released  # the batch is spent
            del self.tables[s], self.queued[s]
        return released

    def _release_tail(self, seq: int, layer: int, table: LayerTable, limit: int | None) -> int:
        """Let go of the table's last `limit` entries (None: all) and truncate it to the rest."""
        n = table.num_blocks
        start = 0 if limit is None else max(0, n - limit)
        if start == n:
            return 0
        tail = table.block_ids[start:]
        self.tiers.release(seq, layer, [start + i for i, b in enumerate(tail) if b != DROPPED])
        table.num_dropped -= tail.count(DROPPED)
        del table.block_ids[start:]
        table.num_tokens = min(table.num_tokens, start * self.block_tokens)
        table.cold_hits = {i: c for i, c in table.cold_hits.items() if i < start}
        return n - start
