"""StepPromotion: the cpu blocks a captured decode step keeps reading move up to the warm tier, at block boundaries.

Each token the step selects a cpu block it stages the block's kv-head slices over PCIe again (cold_slices.py);
the staging launch also adds 1 per slice to `reads` [L, capacity] (device work, no host sync). At a block
boundary, where the step does host work anyway (DecodeStep.end_token of the token that filled the tails),
the host reads the counts once and moves the cpu blocks read at least PROMOTE_AFTER whole blocks' worth of
slices (the eager path's rule: kvstore/decode/eager.py), most read first and at most
Config.promotions_per_boundary, into the warm tier:
  - into free warm slots, as long as one boundary's cooling (a slot per layer of Config.hot_sequences
    sequences) stays free;
  - else by a swap: the sequence's own warm block least worth keeping (lowest H2O worth, the ranking the
    tiers demote by) moves down to the cpu tier, if it is worth less than the block taking its slot. Never
    a sink, a block of the recent or hot window, the tail, or a block another table shares: a swap changes
    nothing of any other sequence (its graph key, its readiness).
Only while the cpu tier holds the warm format: a block keeps its bytes both ways (the cpu tier's int8 is the
warm pool's int8; its sums are taken again from the same bytes when it comes back down), so the step attends
the same values, bit for bit, from another pool. The moves are TierSet.move's (put, then delete; the tables'
slot and tier maps written in place), so captured graphs stay valid; a sequence left with no cpu block
stops staging at its next token (a graph key of its own). Then the counts halve, so reads long past fade;
a promoted block's count restarts from zero.
"""

from __future__ import annotations

import torch

from kvstore.blocks.table import LayerTable
from kvstore.blocks.tierset import CPU_TIER, WARM_TIER
from kvstore.config import Config
from kvstore.decode.cold_slices import StepColdBlocks
from kvstore.decode.eager import PROMOTE_AFTER
from tiers.base import device_ints
from tiers.errors import CapacityError

Entry = tuple[int, int]  # (layer, block index in the table)


class StepPromotion:
    def __init__(self, cold: StepColdBlocks, config: Config, recent_tokens: int) -> None:
        """cold: the step's staging, whose launch counts the slices; recent_tokens: the window the step always
        attends (kept on the GPU, as the sinks and the hot window are)."""
        self.cold, self.tiers, self.stats = cold, cold.tiers, cold.stats
        self.ranking = cold.tiers.demotion.ranking  # H2O: a block's worth is the attention mass it received
        c = config
        self.limit = c.promotions_per_boundary
        self.reserve = c.model.num_layers * c.hot_sequences  # free warm slots one boundary's cooling may take
        self.threshold = PROMOTE_AFTER * c.model.num_kv_heads  # slices: PROMOTE_AFTER whole blocks' worth
        self.block_tokens = c.block_tokens
        self.sink_blocks = -(-c.sink_tokens // c.block_tokens)
        self.kept_tokens = max(recent_tokens, c.hot_tokens)  # the newest tokens' blocks never move down

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
        free = max(0, self.tiers.warm.free_blocks() - self.reserve)
        direct, swapped = wanted[:free], wanted[free:]
        victims: list[Entry] = []
        if swapped:
            swapped, victims = self._swaps(tables, swapped)
        if victims:  # room in the cpu tier checked: nothing is pushed past it, the step still reads them all
            try:
                self.tiers.move(_ids(tables, victims), WARM_TIER, CPU_TIER, coldest=CPU_TIER)
            except CapacityError:  # the cpu tier's memory refused: they stay, and so do the blocks they made room for
                swapped, victims = [], []
        moving = direct + swapped
        moved = self.tiers.promote(_ids(tables, moving), WARM_TIER) if moving else 0
        self.stats.promotions += moved
        self.stats.promotion_swaps += len(victims)
        self._recount((moving if moved else []) + gone)
        return moved

    def _wanted(self, tables: list[LayerTable]) -> tuple[list[Entry], list[Entry]]:
        """(cpu blocks read at least the threshold, most read first, at most the limit; counted entries whose
        blocks left the cpu tier meanwhile). One host sync, two when any entry counts."""
        reads = self.cold.reads
        at = torch.nonzero(reads >= self.threshold)  # [m, 2] (layer, index)
        if not len(at):
            return [], []
        order = torch.argsort(reads[at[:, 0], at[:, 1]], descending=True, stable=True)
        tier_of, wanted, gone = self.tiers.blocks.tier_of, [], []
        for layer, index in at[order].tolist():
            in_cpu = tier_of.get(tables[layer].block_ids[index]) == CPU_TIER
            (wanted if in_cpu else gone).append((layer, index))
        return wanted[: self.limit], gone  # those past the limit keep their counts for the next boundary

    def _swaps(self, tables: list[LayerTable], entries: list[Entry]) -> tuple[list[Entry], list[Entry]]:
        """(entries to promote, the warm entries that make room for them), paired worth-first: the most worth
        of `entries` against the sequence's least worth warm blocks, while those are worth less, as many as the
        cpu tier has room for. Two host syncs."""
        cap = self.cold.reads.shape[1]
        worth = torch.stack([self.ranking.block_worth(t.h2o_scores[:, :cap]) for t in tables])  # [L, cap]
        movable = torch.stack([t.tier_map[:cap] == WARM_TIER for t in tables])  # [L, cap]
        index = torch.arange(cap, device=movable.device)
        for layer, table in enumerate(tables):  # never the sinks, the recent and hot windows, the tail
            first_kept = min(table.num_blocks - 1, max(0, table.num_tokens - self.kept_tokens) // self.block_tokens)
            movable[layer] &= (index >= self.sink_blocks) & (index < first_kept)
        ranked = torch.where(movable, worth, torch.inf).flatten()
        low, at = torch.topk(ranked, min(2 * len(entries), ranked.numel()), largest=False)  # spare: shared ones
        layers, indices = (device_ints([e[i] for e in entries], worth.device) for i in (0, 1))
        incoming = sorted(zip(worth[layers, indices].tolist(), entries), key=lambda x: -x[0])  # most worth first
        registry, room = self.tiers.blocks, self.tiers.cpu.free_blocks()
        outgoing = [(w, (f // cap, f % cap)) for w, f in zip(low.tolist(), at.tolist()) if w != float("inf")]
        outgoing = [(w, e) for w, e in outgoing if registry.refcount(tables[e[0]].block_ids[e[1]]) == 1]
        swapped, victims = [], []
        for (w_in, entry), (w_out, victim) in zip(incoming, outgoing):
            if w_out >= w_in or len(victims) == room:
                break
            swapped.append(entry)
            victims.append(victim)
        return swapped, victims

    def _recount(self, restart: list[Entry]) -> None:
        """Counts halve; those of `restart` (promoted, or no longer in the cpu tier) start again from zero."""
        reads = self.cold.reads
        reads.bitwise_right_shift_(1)
        if restart:
            layers, indices = (device_ints([e[i] for e in restart], reads.device) for i in (0, 1))
            reads[layers, indices] = 0


def _ids(tables: list[LayerTable], entries: list[Entry]) -> list[int]:
    return [tables[layer].block_ids[index] for layer, index in entries]
