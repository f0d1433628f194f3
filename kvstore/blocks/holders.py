"""The table entries that hold each block, kept in step with where the block lives.

The registry (registry.py) records a block's tier and its holders as (sequence, layer, index);
every holder's table mirrors that tier on the device (slot and tier maps, table.py) and in its
warm/cold counts, which the decode path branches on. Whenever a block is recorded in a tier, shared by
one more table or let go, its holders' mirrors follow here, for every holder at once (a block shared
by forks and prefixes moves for all of them). `BlockRegistry.check_tables` verifies the mirrors.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from kvstore.blocks.registry import BlockRegistry
from kvstore.blocks.table import DROPPED, LayerTable, TableTensors
from kvstore.blocks.tier_stack import CPU_TIER, HOT_TIER, WARM_TIER, TierStack


class Holders:
    def __init__(self, tables: dict[int, list[LayerTable]], blocks: BlockRegistry, tensors: TableTensors,
                 stack: TierStack) -> None:
        self.tables, self.blocks, self.tensors, self.stack = tables, blocks, tensors, stack

    def tables_of(self, block_id: int) -> Iterator[tuple[LayerTable, int]]:
        """(table, block index) of every entry holding the block."""
        for seq, layer, index in self.blocks.holders_of(block_id):
            yield self.tables[seq][layer], index

    def owner(self, table: LayerTable, index: int) -> tuple[int, int]:
        """(sequence, layer) of `table`, found through the block its entry `index` holds."""
        return next((s, l) for s, l, i in self.blocks.holders_of(table.block_ids[index])
                    if i == index and self.tables[s][l] is table)

    # -- mirrors ---------------------------------------------------------------------------
    def point(self, ids: Sequence[int], tier: int) -> None:
        """`ids` were just recorded in `tier`: every holder's device maps point there."""
        by_table: dict[tuple[int, int], list[int]] = {}
        for block_id in ids:
            for seq, layer, index in self.blocks.holders_of(block_id):
                by_table.setdefault((seq, layer), []).append(index)
        moved = [(self.tables[seq][layer], indices) for (seq, layer), indices in by_table.items()]
        self.tensors.set_locations([(t, i, self._slots(t, i, tier)) for t, i in moved], tier)

    def enter(self, table: LayerTable, indices: Sequence[int], tier: int) -> None:
        """The blocks of entries `indices` of `table`, which no other entry holds, were just recorded in `tier`
        (an opened context's): the table's count and maps follow, without looking up each block's holders."""
        count_in(table, tier, len(indices))
        self.set_maps(table, list(indices), tier)

    def set_maps(self, table: LayerTable, indices: list[int], tier: int) -> None:
        """Point the table's device maps for entries `indices` at `tier` (slots in the GPU pools and the cpu tier,
        which a captured step reads itself: tiers/slice_gather.py)."""
        self.tensors.set_location(table, indices, self._slots(table, indices, tier), tier)

    def _slots(self, table: LayerTable, indices: list[int], tier: int) -> list[int]:
        pooled = HOT_TIER <= tier <= CPU_TIER
        return self.stack[tier].slots.lookup([table.block_ids[i] for i in indices]) if pooled else [-1] * len(indices)

    def count(self, ids: Sequence[int], tier: int, sign: int) -> None:
        """`ids` entered (+1) or left (-1) `tier`: every holder's warm or cold count follows."""
        if tier == HOT_TIER:
            return
        for (seq, layer), n in self.blocks.entries_per_table(ids).items():
            count_in(self.tables[seq][layer], tier, sign * n)

    # -- sharing ---------------------------------------------------------------------------
    def share(self, seq: int, layer: int, table: LayerTable, indices: list[int]) -> None:
        """Entries `indices` of `table`, registered as (seq, layer), hold the recorded blocks they point at
        (a fork's copy, a prefix): their maps point at each block's tier and the table's counts are set."""
        groups: dict[int, list[int]] = {}
        for i in indices:
            self.blocks.hold(table.block_ids[i], (seq, layer, i))
            groups.setdefault(self.blocks.tier_of[table.block_ids[i]], []).append(i)
        table.num_warm = len(groups.get(WARM_TIER, ()))
        table.num_cold = sum(len(g) for t, g in groups.items() if t > WARM_TIER)
        table.num_far = sum(len(g) for t, g in groups.items() if t > CPU_TIER)
        for tier, group in groups.items():
            self.set_maps(table, group, tier)

    def unshare(self, seq: int, layer: int, table: LayerTable, indices: list[int]) -> None:
        """Undo `share` (the caller empties the table)."""
        for i in indices:
            self.blocks.let_go(table.block_ids[i], (seq, layer, i))

    def let_go(self, seq: int, layer: int, indices: Sequence[int]) -> list[int]:
        """Entries `indices` of (seq, layer) let go of their blocks; the table's counts follow. Returns the
        blocks it was the last holder of: the caller deletes them (their records go with them)."""
        table, last = self.tables[seq][layer], []
        for i in indices:
            block_id = table.block_ids[i]
            if block_id == DROPPED:
                continue
            if self.blocks.refcount(block_id) == 1:
                last.append(block_id)
            else:
                self.blocks.let_go(block_id, (seq, layer, i))
                count_in(table, self.blocks.tier_of[block_id], -1)
        return last


def count_in(table: LayerTable, tier: int, delta: int) -> None:
    if tier == WARM_TIER:
        table.num_warm += delta
    elif tier > WARM_TIER:
        table.num_cold += delta
        if tier > CPU_TIER:
            table.num_far += delta
