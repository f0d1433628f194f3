"""Moving blocks between tiers: placing new blocks, cooling old ones, making room.

A mixin of KVStore (kept apart so each file reads in one sitting); it uses the
store's tiers, block registry, tables and placement policy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from kvstore.placement import COLD, HOT, WARM
from kvstore.table import LayerTable
from tiers.layout import Blocks, Int8Blocks

if TYPE_CHECKING:
    from kvstore.store import KVStore

_VICTIM_POOL = 4  # demote mode: look at this many times more old blocks than needed, keep the least attended


class TierMoves:
    def _place(self: KVStore, ids: list[int], blocks: Blocks, level: int) -> None:
        """Put blocks into tier `level`; what does not fit goes one tier colder, oldest first."""
        room = self._make_room(level, len(ids))
        spill = len(ids) - room
        if spill:
            if level + 1 == len(self.tiers):
                from kvstore.store import CapacityError

                raise CapacityError(f"{self.tiers[level].name} tier is full")
            self._place(ids[:spill], _rows(blocks, slice(0, spill)), level + 1)
        if room:
            self.tiers[level].put(ids[spill:], _rows(blocks, slice(spill, None)))
            self._record(ids[spill:], level)

    def _record(self: KVStore, ids: Sequence[int], level: int) -> None:
        """Book `ids` into tier `level` and point their tables' device maps at them."""
        self.blocks.record(ids, level)
        self._account(ids, level, +1)
        by_table: dict[tuple[int, int], list[int]] = {}
        for block_id in ids:
            seq, layer, index = self.blocks.owner[block_id]
            by_table.setdefault((seq, layer), []).append(index)
        tier = self.tiers[level]
        for (seq, layer), indices in by_table.items():
            table = self.sequences[seq][layer]
            slots = tier.slots.lookup([table.block_ids[i] for i in indices]) if level < COLD else [-1] * len(indices)
            self.tensors.set_location(table, indices, slots, level)

    def _account(self: KVStore, ids: Sequence[int], level: int, sign: int) -> None:
        """Keep each table's count of warm and of cold blocks (the decode path branches on them)."""
        if level == HOT:
            return
        for block_id in ids:
            seq, layer, _ = self.blocks.owner[block_id]
            table = self.sequences[seq][layer]
            if level == WARM:
                table.num_warm += sign
            else:
                table.num_cold += sign

    def _make_room(self: KVStore, level: int, n: int) -> int:
        """Cool victims out of tier `level` until n blocks fit; returns how many fit."""
        tier = self.tiers[level]
        deficit = n - tier.free_blocks()
        if deficit > 0 and level + 1 < len(self.tiers):
            for src, group in self.blocks.by_tier(self._victims(level, deficit)).items():
                self._move(group, src, level + 1)
        return min(n, tier.free_blocks())

    def _victims(self: KVStore, level: int, n: int) -> list[int]:
        """H2O demote mode: among the oldest candidates, the least attended cool first."""
        candidates = self.placement.victims(self.blocks.oldest(level), n * _VICTIM_POOL,
                                            self._is_pinned, self._is_protected)
        if len(candidates) <= n:
            return candidates
        return sorted(candidates, key=self._attention_mass)[:n]

    def _attention_mass(self: KVStore, block_id: int) -> float:
        seq, layer, index = self.blocks.owner[block_id]
        return float(self.sequences[seq][layer].h2o_scores[:, index].max())

    def _move(self: KVStore, ids: list[int], src: int, dst: int) -> None:
        """Move blocks to a colder (or, for promotions, hotter) tier."""
        blocks = self.tiers[src].get(ids)
        self.tiers[src].delete(ids)
        self._account(ids, src, -1)
        self.blocks.forget(ids)
        self._place(ids, blocks, dst)

    def _cool(self: KVStore, table: LayerTable, old_tokens: int) -> None:
        """Demote blocks of `table` that left the hot or warm window."""
        crossed = self.placement.crossing(old_tokens, table.num_tokens, table.num_blocks)
        wanted: dict[tuple[int, int], list[int]] = {}
        for index in crossed:
            block_id = table.block_ids[index]
            if block_id < 0:
                continue  # dropped by H2O
            level = min(self.placement.level(index, table.num_tokens), COLD)
            current = self.blocks.tier_of[block_id]
            if current < level:
                wanted.setdefault((current, level), []).append(block_id)
        for (src, dst), ids in wanted.items():
            self._move(ids, src, dst)

    def _is_pinned(self: KVStore, block_id: int) -> bool:
        """Tail blocks are written in place, so they never leave the hot tier."""
        seq, layer, index = self.blocks.owner[block_id]
        return index == self.sequences[seq][layer].num_blocks - 1

    def _is_protected(self: KVStore, block_id: int) -> bool:
        seq, layer, index = self.blocks.owner[block_id]
        table = self.sequences[seq][layer]
        return self.placement.is_protected(index, table.num_blocks, table.num_tokens)


def _rows(blocks: Blocks, rows: slice) -> Blocks:
    return blocks.index(rows) if isinstance(blocks, Int8Blocks) else blocks[rows]
