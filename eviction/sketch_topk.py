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

coarse_factor=8 rather than 4: the same selections, but twice the blocks carry the fine bound, which
halves the certificate's median overestimate (BENCHMARKS.md); at 1M tokens and budget 4096 the fine
pass reads ~6% of the bytes of the coarse one.

`select_with_bounds` also returns, per q head and block, an upper bound on the log-sum-exp
of the block's true logits (the fine bound on candidates, the coarse one elsewhere, each
already capped by the min/max bound): eviction/certify.py turns it and the attention
kernel's log-sum-exp of the attended blocks into a certified omitted mass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eviction.base import Policy, ScoreContext
from eviction.select import all_blocks, num_selected, protected_mask, top_blocks
from eviction.sketch_kernel import sketch_block_stats, sketch_block_stats_ref


@dataclass
class SketchTopK(Policy):
    coarse_factor: int = 8  # fine-pass candidates per kv head = coarse_factor * k; 0: one full 4-bit pass
    use_kernel: bool | None = None  # None: the Triton kernel on CUDA, the torch reference elsewhere
    # the kernel's tuning knobs (eviction/sketch_kernel.py DEFAULT_KNOBS when empty) for passes over every block
    # and over candidates; bench_longctx/sketch_bench.py sweeps them
    scan_knobs: dict = field(default_factory=dict)
    candidate_knobs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.coarse_factor, bool) or not isinstance(self.coarse_factor, int) or self.coarse_factor < 0:
            raise ValueError(f"coarse_factor must be an int >= 0, got {self.coarse_factor!r}")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """float32 [H, N]: estimated softmax mass per block from the full 4-bit sketch (group mean)."""
        lse, _ = self._stats(ctx, planes=2)
        return block_mass(lse, ctx.num_kv_heads)

    def select(self, ctx: ScoreContext, budget_tokens: int) -> torch.Tensor:
        return self.select_with_bounds(ctx, budget_tokens)[0]

    def coarse(self, ctx: ScoreContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(lse, upper) float32 [Hq, N] from the high plane of every block: what `select_with_bounds` reads
        first; pass it back in to try several budgets on one step (the adaptive mode) for one coarse pass."""
        return self._stats(ctx, planes=1)

    def select_with_bounds(self, ctx: ScoreContext, budget_tokens: int, coarse: tuple[torch.Tensor, torch.Tensor]
                           | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(selected int64 [H, k] rows ascending, block_upper float32 [Hq, N]: upper bounds on each block's
        log-sum-exp of true logits, softmax scale applied)."""
        counts = dict(num_tokens=ctx.num_tokens, block_tokens=ctx.block_tokens, sink_tokens=ctx.sink_tokens,
                      recent_tokens=ctx.recent_tokens)
        k = num_selected(budget_tokens=budget_tokens, **counts)
        if k >= ctx.num_blocks:  # everything is attended: nothing to bound
            upper = torch.full((ctx.q.shape[0], ctx.num_blocks), float("-inf"), device=ctx.device)
            return all_blocks(ctx.num_kv_heads, ctx.num_blocks, ctx.device), upper
        keep = protected_mask(**counts, device=ctx.device)
        if not self.coarse_factor or self.coarse_factor * k >= ctx.num_blocks:
            lse, upper = self._stats(ctx, planes=2)
            return self._pick(lse, keep, torch.zeros_like(keep), k, None, ctx.num_kv_heads), upper
        lse, upper = self.coarse(ctx) if coarse is None else coarse  # the high plane of every block
        fine_pass = {}

        def fine(candidates: torch.Tensor) -> torch.Tensor:
            fine_pass["lse"], fine_pass["upper"] = self._stats(ctx, planes=2, block_ids=candidates)  # [Hq, C]
            fine_pass["rows"] = candidates.repeat_interleave(lse.shape[0] // ctx.num_kv_heads, dim=0)
            return fine_pass["lse"]

        selected = self._pick(lse, keep, torch.zeros_like(keep), k, fine, ctx.num_kv_heads)
        rows = fine_pass["rows"]
        return selected, upper.scatter(1, rows, torch.minimum(fine_pass["upper"], upper.gather(1, rows)))

    def select_masked(self, q: torch.Tensor, summaries: torch.Tensor, sketch: torch.Tensor, valid: torch.Tensor,
                      protected: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(selected int64 [H, k] ascending, block_upper float32 [Hq, N], -inf outside `valid`), with no host
        sync (a captured decode step): the same ranking and bounds as `select_with_bounds` over capacity-sized
        summaries [N, 2, H, D] and sketch whose blocks outside `valid` (bool [N]) may hold garbage;
        `protected` (bool [N]) blocks are kept. Needs k <= the number of valid blocks."""
        stats = self._kernel(summaries)
        n, b = summaries.shape[0], sketch.shape[3]
        num_tokens = n * b  # every token of a valid block is real but the tail's, and the tail is protected
        two_pass = bool(self.coarse_factor) and self.coarse_factor * k < n
        lse, upper = stats(q, summaries, sketch, num_tokens, planes=1 if two_pass else 2)  # [Hq, N] each
        upper = upper.masked_fill(~valid, float("-inf"))

        def fine(candidates: torch.Tensor) -> torch.Tensor:
            nonlocal upper
            fine_lse, fine_upper = stats(q, summaries, sketch, num_tokens, planes=2, block_ids=candidates)
            rows = candidates.repeat_interleave(q.shape[0] // summaries.shape[2], dim=0)  # [Hq, C]
            upper = upper.scatter(1, rows, torch.minimum(fine_upper, upper.gather(1, rows)))
            return fine_lse

        selected = self._pick(lse, protected & valid, ~valid, k, fine if two_pass else None, summaries.shape[2])
        return selected, upper

    def _pick(self, lse: torch.Tensor, keep: torch.Tensor, drop: torch.Tensor, k: int, fine,
              num_kv_heads: int) -> torch.Tensor:
        """int64 [H, k] ascending: the `keep` blocks (bool [N]), never the `drop` ones, the rest by estimated
        mass from lse [Hq, N]; with fine (candidates [H, C] -> lse [Hq, C]) re-ranked by the fine pass over
        the coarse_factor * k best. Shares are of each head's estimated softmax over the real blocks but the
        tail (the last real one, always kept: its codes may lag its keys), so eager and captured steps agree.
        No host sync."""
        real = ~drop
        tail = real & ~torch.cat((real[1:], real.new_zeros(1)))  # [N]: the last real block
        skip = drop | tail

        def ranked(x: torch.Tensor) -> torch.Tensor:
            share = block_mass(x.masked_fill(skip, float("-inf")), num_kv_heads).nan_to_num(nan=float("-inf"))
            return share.masked_fill(drop, float("-inf")).masked_fill(keep & ~drop, float("inf"))

        scores = ranked(lse)
        if fine is not None:
            candidates = top_blocks(scores, min(self.coarse_factor * k, lse.shape[1]))  # [H, C], kept ones first
            rows = candidates.repeat_interleave(lse.shape[0] // num_kv_heads, dim=0)  # [Hq, C]
            lse = lse.scatter(1, rows, fine(candidates))
            scores = torch.full_like(scores, float("-inf")).scatter(1, candidates, ranked(lse).gather(1, candidates))
        return top_blocks(scores, k)

    def _kernel(self, summaries: torch.Tensor):
        """The stats function (q, summaries, codes, num_tokens, planes=, block_ids=) for this device."""
        if not (summaries.is_cuda if self.use_kernel is None else self.use_kernel):
            return sketch_block_stats_ref
        return lambda *args, planes, block_ids=None: sketch_block_stats(
            *args, planes=planes, block_ids=block_ids,
            **(self.scan_knobs if block_ids is None else self.candidate_knobs))

    def _stats(self, ctx: ScoreContext, planes: int, block_ids: torch.Tensor | None = None):
        if ctx.q is None or ctx.sketch is None:
            raise ValueError("SketchTopK needs ctx.q (float16 [num_q_heads, head_dim]) and ctx.sketch "
                             f"(eviction/sketch.py codes), got q={type(ctx.q).__name__}, "
                             f"sketch={type(ctx.sketch).__name__}")
        stats = self._kernel(ctx.summaries)
        return stats(ctx.q, ctx.summaries, ctx.sketch, ctx.num_tokens, planes=planes, block_ids=block_ids)


def block_mass(lse: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Per-(q head, block) log-sum-exp [Hq, N] -> float32 [H, N]: each block's share of the head's
    softmax, averaged over the GQA group."""
    share = torch.softmax(lse.float(), dim=1)  # [Hq, N]
    return share.view(num_kv_heads, -1, lse.shape[1]).mean(1)
