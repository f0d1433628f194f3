"""Which blocks cool first when a tier is full: H2O's demote mode (Zhang et al. 2023, "H2O:
Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models").

Among the oldest blocks of the full tier (a pool DEMOTION_POOL times larger than needed), the
least attended go first; a block shared by several sequences is worth what its most attending
holder gives it. Tail blocks (written in place) and blocks in flight between tiers are pinned;
sinks and the recent window are protected, cooled only when nothing else is left.
"""

from __future__ import annotations

import torch

from eviction.h2o import H2O
from kvstore.blocks.holders import Holders
from kvstore.blocks.placement import Placement
from kvstore.blocks.registry import BlockRegistry

DEMOTION_POOL = 4  # look at this many times more old blocks than needed, keep the least attended


class Demotion:
    def __init__(self, holders: Holders, blocks: BlockRegistry, placement: Placement, in_flight: set[int]) -> None:
        self.holders, self.blocks, self.placement, self.in_flight = holders, blocks, placement, in_flight
        self.ranking = H2O()

    def victims(self, tier: int, n: int) -> list[int]:
        """Up to n block ids of `tier` to cool, least attended of the oldest first."""
        candidates = self.placement.victims(self.blocks.oldest(tier), n * DEMOTION_POOL, self.is_pinned,
                                            self.is_protected)
        if len(candidates) <= n:
            return candidates
        worth = self.worths(candidates)
        return [candidates[i] for i in sorted(range(len(candidates)), key=worth.__getitem__)[:n]]

    def worths(self, ids: list[int]) -> list[float]:
        """Each block's H2O worth, the most its holders give it: every holder's scores gathered into one
        [kv_heads, M] tensor and read back once (one host sync for all, not one per block)."""
        columns, owner = [], []
        for i, block_id in enumerate(ids):
            for table, index in self.holders.tables_of(block_id):
                columns.append(table.h2o_scores[:, index])
                owner.append(i)
        out = [float("-inf")] * len(ids)
        if columns:
            for i, value in zip(owner, self.ranking.block_worth(torch.stack(columns, dim=1)).tolist()):
                out[i] = max(out[i], value)
        return out

    def is_pinned(self, block_id: int) -> bool:
        """Tail blocks are written in place, so they never leave the hot tier; moving blocks stay put."""
        return block_id in self.in_flight or any(index == table.num_blocks - 1
                                                 for table, index in self.holders.tables_of(block_id))

    def is_protected(self, block_id: int) -> bool:
        return any(self.placement.is_protected(index, t.num_blocks, t.num_tokens)
                   for t, index in self.holders.tables_of(block_id))
