"""StepPromotion: the cpu blocks a captured decode step keeps reading move up to the warm tier, at block boundaries.

Each token the step selects a cpu block it stages the block's kv-head slices over PCIe again (cold_slices.py);
the staging launch also adds 1 per slice to `reads` [L, capacity] (device work, no host sync). At a block
boundary, where the step does host work anyway (DecodeStep.end_token of the token that filled the tails),
the device picks the cpu blocks read at least PROMOTE_AFTER whole blocks' worth of slices, most read first
and at most Config.promotions_per_boundary (the host reads only those), and they move into the warm tier by
the rule both decode paths share (kvstore/blocks/promotion.py: free warm slots, else a swap with a warm block
of the sequence worth less).
Only while the cpu tier holds the warm format: a block keeps its bytes both ways (the cpu tier's int8 is the
warm pool's int8; its sums are taken again from the same bytes when it comes back down), so the step attends
the same values, bit for bit, from another pool. The moves are TierSet.move's (put, then delete; the tables'
slot and tier maps written in place), so captured graphs stay valid; a sequence left with no cpu block
stops staging at its next token (a graph key of its own). Then the counts halve, so reads long past fade;
a promoted block's count restarts from zero, as does one whose block left the cpu tier meanwhile.
"""

from __future__ import annotations

import torch

from kvstore.blocks.promotion import PROMOTE_AFTER, Entry, Promoter
from kvstore.blocks.table import LayerTable
from kvstore.blocks.tierset import CPU_TIER
from kvstore.config import Config
from kvstore.decode.cold_slices import StepColdBlocks
from tiers.base import device_ints


class StepPromotion:
    def __init__(self, cold: StepColdBlocks, config: Config, recent_tokens: int) -> None:
        """cold: the step's staging, whose launch counts the slices; recent_tokens: the window the step always
        attends (kept on the GPU, as the sinks and the hot window are)."""
        self.cold, self.tiers, self.stats = cold, cold.tiers, cold.stats
        self.rule = Promoter(cold.tiers, config, recent_tokens)
        self.limit = config.promotions_per_boundary
        self.threshold = PROMOTE_AFTER * config.model.num_kv_heads  # slices: PROMOTE_AFTER whole blocks' worth

    def keeps_bytes(self) -> bool:
        """Whether promotion is on and moves blocks unchanged (the cpu tier holds the warm format)."""
        return self.limit > 0 and self.tiers.cpu.dtype == self.tiers.layout.warm_format

    def at_boundary(self, tables: list[LayerTable]) -> int:
        """Host side, between tokens, at a block boundary (module docstring): IntegrityError first if a slice
        read since the last boundary was damaged, then the moves. Returns how many blocks moved up."""
        cold = self.cold
        if not cold.staged_since_boundary:
            return 0
        cold.verify()
        cold.staged_since_boundary = False
        if not self.keeps_bytes():
            return 0
        wanted, gone = self._wanted(tables)
        moving, moved, swaps = self.rule.promote(tables, wanted, self.cold.reads.shape[1]) if wanted else ([], 0, 0)
        self.stats.promotions += moved
        self.stats.promotion_swaps += swaps
        self._recount(moving if moved else [], gone)
        return moved

    def _wanted(self, tables: list[LayerTable]) -> tuple[list[Entry], torch.Tensor]:
        """(cpu blocks read at least the threshold, most read first, at most the limit; bool [L, capacity]: the
        counted entries whose blocks left the cpu tier meanwhile). Decided on the device from the counts and the
        tables' tier maps (in step with the registry: kvstore/blocks/holders.py), so the host handles only the
        entries it promotes, not every counted one; two host syncs, one when none is wanted."""
        reads = self.cold.reads  # [L, capacity]
        capacity = reads.shape[1]
        counted = reads >= self.threshold
        in_cpu = torch.stack([t.tier_map[:capacity] for t in tables]) == CPU_TIER  # [L, capacity]
        wanted, gone = counted & in_cpu, counted & ~in_cpu
        num_wanted = int(wanted.sum())
        if not num_wanted:
            return [], gone
        # most read first, ties in (layer, index) order; those past the limit keep their counts for the next boundary
        order = torch.argsort(torch.where(wanted, reads, -1).flatten(), descending=True, stable=True)
        return [divmod(f, capacity) for f in order[:min(num_wanted, self.limit)].tolist()], gone

    def _recount(self, restart: list[Entry], gone: torch.Tensor) -> None:
        """Counts halve; those of `restart` (promoted) and of `gone` (bool [L, capacity]: no longer in the cpu
        tier) start again from zero."""
        reads = self.cold.reads
        reads.bitwise_right_shift_(1)
        reads.masked_fill_(gone, 0)
        if restart:
            layers, indices = (device_ints([e[i] for e in restart], reads.device) for i in (0, 1))
            reads[layers, indices] = 0
