"""H2O, heavy-hitter oracle (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for
Efficient Generative Inference of Large Language Models"): a block's worth is
the attention mass it has received so far.

The decode kernel emits per-step mass `block_mass` float32 [kv_heads, n] (n blocks
attended, optionally with their `block_ids` [kv_heads, n]); `H2OAccumulator` sums
it per sequence and layer. The scores serve two modes:

- drop mode (classic H2O): the sequence keeps at most `keep_tokens`; `h2o_evict`
  names the blocks to drop for good (the store frees them), never sinks or the
  recent window.
- demote mode: nothing is lost; `coldest` ranks which blocks leave a tier first.

Both decide per block, not per head, because a block stores every kv head: it is
freed or moved as a whole. Heads are combined with max (default: a block heavy for
any one head stays, since each head's mass per step sums to 1 the heads are on one
scale) or sum (total mass). `H2O.select` uses the per-head scores directly, for a
budgeted per-head selection that drops nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from eviction.base import Policy, ScoreContext
from eviction.select import cdiv, num_selected, protected_range

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

    def evict(self, ctx: ScoreContext, keep_tokens: int, dropped: Sequence[int] = ()) -> list[int]:
        """Drop mode: the blocks to free now so at most max(protected, keep_tokens // block_tokens) stay."""
        return h2o_evict(
            self.score(ctx),
            num_tokens=ctx.num_tokens,
            block_tokens=ctx.block_tokens,
            keep_tokens=keep_tokens,
            sink_tokens=ctx.sink_tokens,
            recent_tokens=ctx.recent_tokens,
            dropped=dropped,
            head_reduce=self.head_reduce,
        )


@dataclass(slots=True)
class H2OAccumulator:
    """Running H2O scores of one sequence and layer: float32 [kv_heads, capacity], grown by doubling.

    Growing reallocates, so a captured CUDA graph must not hold `scores` across a growth.
    """

    num_kv_heads: int
    device: torch.device | str = "cpu"
    capacity_blocks: int = 64
    num_blocks: int = 0
    _buffer: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "capacity_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"H2OAccumulator.{name} must be >= 1, got {getattr(self, name)}")
        capacity = max(self.capacity_blocks, self.num_blocks)
        self._buffer = torch.zeros(self.num_kv_heads, capacity, dtype=torch.float32, device=self.device)  # [H, C]

    @property
    def scores(self) -> torch.Tensor:
        """float32 [kv_heads, num_blocks], a view: new blocks start at 0."""
        return self._buffer[:, : self.num_blocks]

    def ensure(self, num_blocks: int) -> None:
        """Track at least `num_blocks` blocks (never shrinks)."""
        if num_blocks > self._buffer.shape[1]:
            capacity = max(num_blocks, 2 * self._buffer.shape[1])
            grown = torch.zeros(self.num_kv_heads, capacity, dtype=torch.float32, device=self._buffer.device)
            grown[:, : self.num_blocks] = self.scores
            self._buffer = grown
        self.num_blocks = max(self.num_blocks, num_blocks)

    def add(
        self, block_mass: torch.Tensor, block_ids: torch.Tensor | None = None, num_blocks: int | None = None
    ) -> None:
        """Add one step's mass: dense over blocks [0, n) or, with block_ids [kv_heads, n], scattered.

        num_blocks (the sequence's block count now) defaults to n for dense mass;
        block_ids must all be below it (not checked: that would sync the GPU).
        """
        if block_mass.dim() != 2 or block_mass.shape[0] != self.num_kv_heads:
            raise ValueError(f"block_mass: expected [{self.num_kv_heads}, n], got {list(block_mass.shape)}")
        n = block_mass.shape[1]
        if block_ids is None:
            self.ensure(max(n, num_blocks or 0))
            self._buffer[:, :n] += block_mass
            return
        if block_ids.shape != block_mass.shape or block_ids.dtype != torch.int64:
            raise ValueError(
                f"block_ids: expected int64 {list(block_mass.shape)}, got {block_ids.dtype} {list(block_ids.shape)}"
            )
        self.ensure(num_blocks or 0)
        self._buffer.scatter_add_(1, block_ids, block_mass.float())


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


def coldest(
    scores: torch.Tensor, n: int, protected: torch.Tensor | None = None, head_reduce: str = "max"
) -> list[int]:
    """Demote mode: the n least-attended blocks, coldest first, never a protected one.

    scores: float [kv_heads, num_blocks] or [num_blocks]; protected: bool [num_blocks].
    """
    block_scores = _per_block(scores, head_reduce)  # [N]
    num_blocks = block_scores.shape[0]
    if protected is None:
        protected = torch.zeros(num_blocks, dtype=torch.bool, device=block_scores.device)
    if protected.shape != (num_blocks,) or protected.dtype != torch.bool:
        raise ValueError(f"protected: expected bool [{num_blocks}], got {protected.dtype} {list(protected.shape)}")
    num_candidates = num_blocks - int(protected.sum())
    if not 0 <= n <= num_candidates:
        raise ValueError(f"n: expected 0 <= n <= {num_candidates} unprotected blocks, got {n}")
    return _lowest(block_scores, n, protected.to(block_scores.device))


def h2o_evict(
    scores: torch.Tensor,
    *,
    num_tokens: int,
    block_tokens: int,
    keep_tokens: int,
    sink_tokens: int,
    recent_tokens: int,
    dropped: Sequence[int] = (),
    head_reduce: str = "max",
) -> list[int]:
    """Drop mode: block indices to free now, ascending, so that at most k blocks stay live.

    k = max(protected, keep_tokens // block_tokens) as in `select`. `dropped` lists the
    blocks freed by earlier calls (they are neither live nor candidates); the lowest
    scoring live, unprotected blocks go first.
    """
    num_blocks = cdiv(num_tokens, block_tokens)
    block_scores = _per_block(scores, head_reduce)  # [N]
    if block_scores.shape[0] != num_blocks:
        raise ValueError(f"scores: expected {num_blocks} blocks for {num_tokens} tokens, got {block_scores.shape[0]}")
    keep = num_selected(
        num_tokens=num_tokens,
        block_tokens=block_tokens,
        budget_tokens=keep_tokens,
        sink_tokens=sink_tokens,
        recent_tokens=recent_tokens,
    )
    sink_blocks, recent_start = protected_range(
        num_tokens=num_tokens, block_tokens=block_tokens, sink_tokens=sink_tokens, recent_tokens=recent_tokens
    )
    dropped = sorted(set(dropped))
    bad = [b for b in dropped if not sink_blocks <= b < recent_start]
    if bad:
        raise ValueError(f"dropped: expected unprotected blocks in [{sink_blocks}, {recent_start}), got {bad[:8]}")
    num_drop = num_blocks - len(dropped) - keep
    if num_drop <= 0:
        return []
    excluded = torch.ones(num_blocks, dtype=torch.bool)  # [N], built on the host: one copy to the device
    excluded[sink_blocks:recent_start] = False
    excluded[dropped] = True
    return sorted(_lowest(block_scores, num_drop, excluded.to(block_scores.device)))
