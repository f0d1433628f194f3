"""Which cpu blocks move up to the warm tier, and which warm blocks make room for them.

Both decode paths promote the cpu blocks they keep reading (a captured step at block boundaries:
kvstore/decode/promotion.py; the DecodePath after an attend: kvstore/decode/eager.py), by one rule:
  - into free warm slots, as long as one boundary's cooling (a slot per layer of Config.hot_sequences
    sequences) stays free;
  - else by a swap: the sequence's own warm block least worth keeping (lowest H2O worth, the ranking the
    tiers demote by) moves down to the cpu tier, if it is worth less than the block taking its slot. Never
    a sink, a block of the recent or hot window, the tail, or a block another table shares: a swap changes
    nothing of any other sequence.
A full warm tier thus trades a block only for one that received less attention: an attention that reads
every block (dense) does not shuttle the same blocks up and down token after token.
"""

from __future__ import annotations

import torch

from kvstore.blocks.table import LayerTable
from kvstore.blocks.tier_stack import CPU_TIER, WARM_TIER
from kvstore.blocks.tierset import TierSet
from kvstore.config import Config
from tiers.base import device_ints
from tiers.errors import CapacityError

PROMOTE_AFTER = 2  # whole-block reads of a cpu block (since its count last halved or restarted) before it moves up
Entry = tuple[int, int]  # (index of the table in the caller's list, block index in that table)


class Promoter:
    def __init__(self, tiers: TierSet, config: Config, recent_tokens: int) -> None:
        """recent_tokens: the window the caller always attends (kept on the GPU, as
        the sinks and the hot window are)."""
        self.tiers = tiers
        self.ranking = tiers.demotion.ranking  # H2O: a block's worth is the attention mass it received
        c = config
        self.reserve = c.model.num_layers * c.hot_sequences  # free warm slots one boundary's cooling may take
        self.block_tokens = c.block_tokens
        self.sink_blocks = -(-c.sink_tokens // c.block_tokens)
        self.kept_tokens = max(recent_tokens, c.hot_tokens)  # the newest tokens' blocks never move down

    def promote(self, tables: list[LayerTable], wanted: list[Entry], cap: int) -> tuple[list[Entry], int, int]:
        """Move `wanted` (cpu blocks, most wanted first) up where the rule allows; cap: how many blocks of each
        table to consider for a swap. Returns (the entries moved, how many moved, how many warm blocks went
        down to make room)."""
        free = max(0, self.tiers.warm.free_blocks() - self.reserve)
        direct, swapped = wanted[:free], wanted[free:]
        victims: list[Entry] = []
        if swapped:
            swapped, victims = self._swaps(tables, swapped, cap)
        if victims:  # room in the cpu tier checked: nothing is pushed past it
            try:
                self.tiers.move(_ids(tables, victims), WARM_TIER, CPU_TIER, coldest=CPU_TIER)
            except CapacityError:  # the cpu tier's memory refused: they stay, and so do the blocks they made room for
                swapped, victims = [], []
        moving = direct + swapped
        moved = self.tiers.promote(_ids(tables, moving), WARM_TIER) if moving else 0
        return moving, moved, len(victims)

    def _swaps(self, tables: list[LayerTable], entries: list[Entry], cap: int) -> tuple[list[Entry], list[Entry]]:
        """(entries to promote, the warm entries that make room for them), paired worth-first: the most worth
        of `entries` against the sequence's least worth warm blocks, while those are worth less, as many as the
        cpu tier has room for. Two host syncs."""
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


def _ids(tables: list[LayerTable], entries: list[Entry]) -> list[int]:
    return [tables[layer].block_ids[index] for layer, index in entries]
