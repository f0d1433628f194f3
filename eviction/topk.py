"""Query-aware top-K block selection, Quest (Tang et al. 2024, "Quest: Query-Aware
Sparsity for Efficient Long-Context LLM Inference").

Each block is scored by an upper bound of q . k over its keys, computed from the
block's key min/max summary (eviction/quest_kernel.py), and the best blocks per
kv head fill the budget. On CUDA the fused Triton kernel scores and protects in
one pass; on CPU the torch reference runs instead (the Triton interpreter is for
tests, far too slow for use).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eviction.policy import Policy, ScoreContext
from eviction.quest_kernel import check_inputs, quest_scores, quest_scores_ref
from eviction.select import SeqWindow, all_blocks, check_window, select, top_blocks


@dataclass
class TopK(Policy):
    group_reduce: str = "max"  # combine a GQA group's q heads: "max" (bounds every head) or "sum"

    def __post_init__(self) -> None:
        if self.group_reduce not in ("max", "sum"):
            raise ValueError(f"group_reduce must be 'max' or 'sum', got {self.group_reduce!r}")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        q = _query(ctx)
        if ctx.summaries.is_cuda:
            return quest_scores(q, ctx.summaries, group_reduce=self.group_reduce)
        return quest_scores_ref(q, ctx.summaries, group_reduce=self.group_reduce)

    def select(self, ctx: ScoreContext, budget_tokens: int) -> torch.Tensor:
        # Same result as the shared select; overridden only so the kernel writes the
        # protected blocks' +inf itself, one launch fewer per layer and step.
        return topk_select(_query(ctx), ctx.summaries, ctx.window, budget_tokens=budget_tokens,
                           group_reduce=self.group_reduce)


def _query(ctx: ScoreContext) -> torch.Tensor:
    if ctx.q is None:
        raise ValueError("TopK needs ctx.q (float16 [num_q_heads, head_dim]), got None")
    return ctx.q


def topk_select(
    q: torch.Tensor,
    summaries: torch.Tensor,
    window: SeqWindow,
    *,
    budget_tokens: int,
    group_reduce: str = "max",
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """int64 [kv_heads, k]: Quest score + shared selection, rows sorted ascending (tail block last).

    q: float16 [num_q_heads, head_dim]; summaries: float16 (or float8_e4m3fn from
    `summaries_to_fp8`) [num_blocks, 2, kv_heads, head_dim]. use_kernel defaults to
    "summaries are on CUDA". Kernel path: one scoring launch that also sets the
    protected blocks to +inf, then topk and a sort of the k winners; no host sync,
    so it can be captured in a CUDA graph. A budget covering everything launches nothing.
    """
    num_blocks, num_kv_heads, _ = check_inputs(q, summaries, group_reduce)
    k = check_window(window).num_selected(budget_tokens)
    if num_blocks != window.num_blocks:
        expected = f"{window.num_blocks} blocks for {window.num_tokens} tokens"
        raise ValueError(f"summaries: expected {expected}, got {num_blocks}")
    if k >= num_blocks:
        return all_blocks(num_kv_heads, num_blocks, summaries.device)
    if not (summaries.is_cuda if use_kernel is None else use_kernel):
        scores = quest_scores_ref(q, summaries, group_reduce=group_reduce)
        return select(scores, window, budget_tokens)
    sink_blocks, recent_start = window.protected_range()
    scores = quest_scores(q, summaries, group_reduce=group_reduce, sink_blocks=sink_blocks, recent_start=recent_start)
    return top_blocks(scores, k)
