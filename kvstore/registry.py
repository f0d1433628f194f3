"""Where every block is: its tier, its owner, and each tier's arrival order."""

from __future__ import annotations

from typing import Iterator, Sequence


class BlockRegistry:
    """Global block ids -> (tier index, owner). Plain dicts: the store touches it per block move,
    never per token, and the decode path reads the per-table device maps instead."""

    def __init__(self, num_tiers: int) -> None:
        self.tier_of: dict[int, int] = {}  # block id -> index into KVStore.tiers
        self.owner: dict[int, tuple[int, int, int]] = {}  # block id -> (sequence, layer, block index)
        self.order: list[dict[int, None]] = [{} for _ in range(num_tiers)]  # per tier, oldest arrival first
        self._next = 0

    def new_ids(self, n: int, seq: int, layer: int, first_index: int) -> list[int]:
        ids = list(range(self._next, self._next + n))
        self._next += n
        for offset, block_id in enumerate(ids):
            self.owner[block_id] = (seq, layer, first_index + offset)
        return ids

    def record(self, ids: Sequence[int], tier: int) -> None:
        """`ids` now live in `tier` (leaving the tier they were in, if any)."""
        for block_id in ids:
            old = self.tier_of.get(block_id)
            if old is not None:
                del self.order[old][block_id]
            self.tier_of[block_id] = tier
            self.order[tier][block_id] = None

    def forget_owners(self, ids: Sequence[int]) -> None:
        """Ids handed out by new_ids that were never recorded in a tier (a refused append)."""
        for block_id in ids:
            del self.owner[block_id]

    def remove(self, ids: Sequence[int]) -> None:
        """`ids` are gone from every tier and every table."""
        for block_id in ids:
            del self.order[self.tier_of.pop(block_id)][block_id]
            del self.owner[block_id]

    def by_tier(self, ids: Sequence[int]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for block_id in ids:
            groups.setdefault(self.tier_of[block_id], []).append(block_id)
        return groups

    def oldest(self, tier: int) -> Iterator[int]:
        return iter(self.order[tier])

    def check(self, tiers: Sequence) -> None:
        for index, tier in enumerate(tiers):
            recorded = self.order[index]
            if tier.num_blocks != len(recorded) or any(i not in tier for i in recorded):
                raise AssertionError(f"{tier.name}: {tier.num_blocks} blocks stored, {len(recorded)} recorded")
        if sum(len(o) for o in self.order) != len(self.tier_of) or len(self.tier_of) != len(self.owner):
            raise AssertionError("block records disagree: a block is in two tiers or in none")
