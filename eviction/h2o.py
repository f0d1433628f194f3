"""H2O, heavy-hitter oracle (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for
Efficient Generative Inference of Large Language Models"): a block's worth is
the attention mass it has received so far.

The decode kernel emits per-step mass float32 [kv_heads, n] for the n blocks it attended;
the store adds it into each table's `h2o_scores`. The scores serve two modes:

- drop mode (classic H2O): the sequence keeps at most `keep_tokens`; `h2o_evict`
  names the blocks to drop for good (the store frees them), never sinks or the
  recent window.
- demote mode: nothing is lost; `block_worth` ranks which blocks leave a tier first.

Both decide per block, not per head, because a block stores every kv head: it is
freed or moved as a whole. Heads are combined with max (default: a block heavy for
any one head stays, since each head's mass per step sums to 1 the heads are on one
scale) or sum (total mass). `H2O.select` uses the per-head scores directly, for a
budgeted per-head selection that drops nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eviction.policy import Policy, ScoreContext
from eviction.select import SeqWindow, check_window

_REDUCES = ("max", "sum")


@dataclass
class H2O(Policy):
    head_reduce: str = "max"  # how drop/demote combine kv heads: "max" or "sum"

    def __post_init__(self) -> None:
        if self.head_reduce not in _REDUCES:
            raise ValueError(f"head_reduce must be one of {_REDUCES}, got {self.head_reduce!r}")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        if ctx.h2o_scores is None:
            raise ValueError("H2O needs ctx.h2o_scores (float32 [kv_heads, num_blocks]), got None")
        return ctx.h2o_scores

    def block_worth(self, scores: torch.Tensor) -> torch.Tensor:
        """float32 [N] from scores [kv_heads, N]: one worth per block (a block moves with all its heads)."""
        return _per_block(scores, self.head_reduce)

    def evict(self, ctx: ScoreContext, keep_tokens: int, dropped: Sequence[int] = ()) -> list[int]:
        """Drop mode: the blocks to free now so at most max(protected, keep_tokens // block_tokens) stay."""
        return h2o_evict(self.score(ctx), ctx.window, keep_tokens=keep_tokens, dropped=dropped,
                         head_reduce=self.head_reduce)


def _per_block(scores: torch.Tensor, head_reduce: str) -> torch.Tensor:
    """float32 [N] from [kv_heads, N] (or [N])."""
    if head_reduce not in _REDUCES:
        raise ValueError(f"head_reduce must be one of {_REDUCES}, got {head_reduce!r}")
    if scores.dim() == 1:
        return scores.float()
    if scores.dim() != 2:
        raise ValueError(f"scores: expected [kv_heads, num_blocks] or [num_blocks], got {list(scores.shape)}")
    return scores.float().amax(0) if head_reduce == "max" else scores.float().sum(0)


def _lowest(block_scores: torch.Tensor, n: int, excluded: torch.Tensor) -> list[int]:
    """The n lowest-scoring blocks outside `excluded`, coldest first (n must not exceed the candidates)."""
    candidates = block_scores.nan_to_num(nan=float("-inf")).masked_fill(excluded, float("inf"))
    return torch.topk(candidates, n, largest=False, sorted=True).indices.tolist()


def h2o_evict(
    scores: torch.Tensor,
    window: SeqWindow,
    *,
    keep_tokens: int,
    dropped: Sequence[int] | torch.Tensor = (),
    head_reduce: str = "max",
) -> list[int]:
    """Drop mode: block indices to free now, ascending, so that at most k blocks stay live.

    k = max(protected, keep_tokens // block_tokens) as in `select`. `dropped` lists the
    blocks freed by earlier calls (they are neither live nor candidates; ints, or an int64
    host tensor, which a long sequence's caller keeps instead of a list); the lowest
    scoring live, unprotected blocks go first.
    """
    num_blocks = check_window(window).num_blocks
    block_scores = _per_block(scores, head_reduce)  # [N]
    if block_scores.shape[0] != num_blocks:
        raise ValueError(
            f"scores: expected {num_blocks} blocks for {window.num_tokens} tokens, got {block_scores.shape[0]}"
        )
    keep = window.num_selected(keep_tokens)
    sink_blocks, recent_start = window.protected_range()
    dropped = torch.unique(torch.as_tensor(dropped, dtype=torch.int64).cpu())  # distinct, ascending (host)
    bad = dropped[(dropped < sink_blocks) | (dropped >= recent_start)]
    if bad.numel():
        raise ValueError(f"dropped: expected unprotected blocks in [{sink_blocks}, {recent_start}), "
                         f"got {bad[:8].tolist()}")
    num_drop = num_blocks - dropped.numel() - keep
    if num_drop <= 0:
        return []
    excluded = torch.ones(num_blocks, dtype=torch.bool)  # [N], built on the host: one copy to the device
    excluded[sink_blocks:recent_start] = False
    excluded[dropped] = True
    return sorted(_lowest(block_scores, num_drop, excluded.to(block_scores.device)))
