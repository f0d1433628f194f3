"""ShardedSelection: what the ranks of a ShardedSequence select, computed in one process over the whole sequence.

A policy for store.attend (a policy instance is a mode): over a whole sequence it runs every rank's part of the
selection (shards.py: the shard's bounds and protected blocks, the budget rule, the shard's selection) with
the exchange in place of the all_gather, and returns the union. One process then attends exactly the blocks
the ranks attend together, so a sharded decode must give its outputs (tests/kvstore/parallel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eviction import Policy, ScoreContext
from eviction.select import all_blocks
from kvstore.parallel.shards import ShardPlan, allot_free_blocks, free_to_select, free_top, select_shard, shard_scores


@dataclass
class ShardedSelection(Policy):
    plan: ShardPlan
    mode: str  # "topk" or "sketch": the ranks' policy
    topk: Policy  # the Quest bound the budget rule ranks by (the store's policies["topk"])
    policy: Policy  # the policy of `mode` (the store's policies[mode])

    def __post_init__(self) -> None:
        if self.mode not in ("topk", "sketch"):
            raise ValueError(f"mode must be 'topk' or 'sketch', got {self.mode!r}")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        raise ValueError("ShardedSelection selects blocks per shard; it has no score of the whole sequence")

    def select(self, ctx: ScoreContext, budget_tokens: int) -> torch.Tensor:
        """int64 [H, k]: the union of every rank's selection, ascending (global block indices)."""
        window, n = ctx.window, ctx.num_blocks
        k_free = free_to_select(window, budget_tokens)
        if k_free is None:
            return all_blocks(ctx.num_kv_heads, n, ctx.device)
        ends = [*self.plan.starts[1:], n]
        scored = [shard_scores(self.topk, window, a, ctx.summaries[a:b], ctx.q) for a, b in zip(self.plan.starts, ends)]
        extra = allot_free_blocks(torch.stack([free_top(*s, k_free) for s in scored]), k_free)
        parts = [select_shard(self.mode, self.policy, bounds, protected, int(extra[r]), ctx.q, ctx.summaries[a:b],
                              ctx.sketch[a:b] if ctx.sketch is not None else None) + a
                 for r, ((bounds, protected), a, b) in enumerate(zip(scored, self.plan.starts, ends))]
        return torch.cat(parts, dim=1)
