"""Top-K blocks by the softmax mass a 4-bit key sketch estimates for them (Twilight, Lin et al. 2025;
Double Sparsity, Yang et al. 2024), hierarchically, with a certified bound on what was left out.

Every block keeps a 4-bit sketch of its keys on the GPU wherever its K/V lives
(eviction/sketch.py, ScoreContext.sketch). A step reads the high 2-bit plane of every
block (the coarse pass), keeps `coarse_factor` x k candidates per kv head, reads both
planes of those (the fine pass) and keeps the k of highest estimated mass: per q head
the block's share of the estimated softmax, averaged over the GQA group. Candidates
always include the protected blocks (sinks, recent window). On real SmolLM2 Q/K this
matches selecting by the full 4-bit scan and holds >= 99% of the oracle's mass
(BENCHMARKS.md "Selection quality"); coarse_factor=0 runs the full 4-bit scan instead.

`select_with_bounds` also returns, per q head and block, an upper bound on the log-sum-exp
of the block's true logits (the fine bound on candidates, the coarse one elsewhere, each
already capped by the min/max bound): eviction/certify.py turns it and the attention
kernel's log-sum-exp of the attended blocks into a certified omitted mass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eviction.base import Policy, ScoreContext
from eviction.select import num_selected, protected_mask, select, top_blocks
from eviction.sketch_kernel import sketch_block_stats, sketch_block_stats_ref


@dataclass
class SketchTopK(Policy):
    coarse_factor: int = 4  # fine-pass candidates per kv head = coarse_factor * k; 0: one full 4-bit pass
    use_kernel: bool | None = None  # None: the Triton kernel on CUDA, the torch reference elsewhere

    def __post_init__(self) -> None:
        if isinstance(self.coarse_factor, bool) or not isinstance(self.coarse_factor, int) or self.coarse_factor < 0:
            raise ValueError(f"coarse_factor must be an int >= 0, got {self.coarse_factor!r}")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """float32 [H, N]: estimated softmax mass per block from the full 4-bit sketch (group mean)."""
        lse, _ = self._stats(ctx, planes=2)
        return block_mass(lse, ctx.num_kv_heads)

    def select(self, ctx: ScoreContext, budget_tokens: int) -> torch.Tensor:
        return self.select_with_bounds(ctx, budget_tokens)[0]

    def select_with_bounds(self, ctx: ScoreContext, budget_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(selected int64 [H, k] rows ascending, block_upper float32 [Hq, N]: upper bounds on each block's
        log-sum-exp of true logits, softmax scale applied)."""
        counts = dict(num_tokens=ctx.num_tokens, block_tokens=ctx.block_tokens, sink_tokens=ctx.sink_tokens,
                      recent_tokens=ctx.recent_tokens)
        k = num_selected(budget_tokens=budget_tokens, **counts)
        num_candidates = self.coarse_factor * k
        if not self.coarse_factor or num_candidates >= ctx.num_blocks:
            lse, upper = self._stats(ctx, planes=2)
            return select(block_mass(lse, ctx.num_kv_heads), budget_tokens=budget_tokens, **counts), upper
        lse, upper = self._stats(ctx, planes=1)  # coarse: the high plane of every block
        protected = protected_mask(**counts, device=ctx.device)
        coarse = block_mass(lse, ctx.num_kv_heads).masked_fill(protected, float("inf"))
        candidates = top_blocks(coarse, num_candidates)  # [H, C], the protected blocks among them
        fine_lse, fine_upper = self._stats(ctx, planes=2, block_ids=candidates)  # [Hq, C]
        rows = candidates.repeat_interleave(lse.shape[0] // ctx.num_kv_heads, dim=0)  # [Hq, C]
        lse = lse.scatter(1, rows, fine_lse)
        upper = upper.scatter(1, rows, torch.minimum(fine_upper, upper.gather(1, rows)))
        scores = torch.full_like(coarse, float("-inf")).scatter(1, candidates, block_mass(lse, ctx.num_kv_heads)
                                                               .gather(1, candidates))
        return select(scores, budget_tokens=budget_tokens, **counts), upper

    def _stats(self, ctx: ScoreContext, planes: int, block_ids: torch.Tensor | None = None):
        if ctx.q is None or ctx.sketch is None:
            raise ValueError("SketchTopK needs ctx.q (float16 [num_q_heads, head_dim]) and ctx.sketch "
                             f"(eviction/sketch.py codes), got q={type(ctx.q).__name__}, "
                             f"sketch={type(ctx.sketch).__name__}")
        use_kernel = ctx.summaries.is_cuda if self.use_kernel is None else self.use_kernel
        stats = sketch_block_stats if use_kernel else sketch_block_stats_ref
        return stats(ctx.q, ctx.summaries, ctx.sketch, ctx.num_tokens, planes=planes, block_ids=block_ids)


def block_mass(lse: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Per-(q head, block) log-sum-exp [Hq, N] -> float32 [H, N]: each block's share of the head's
    softmax, averaged over the GQA group."""
    share = torch.softmax(lse.float(), dim=1)  # [Hq, N]
    return share.view(num_kv_heads, -1, lse.shape[1]).mean(1)
