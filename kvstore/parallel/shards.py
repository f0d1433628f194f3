"""Which blocks of a sharded sequence each rank holds, which of them a budgeted step must keep, and how many
more each rank selects.

The budget rule (`allot_free_blocks`): a budgeted step of one process keeps, per kv head, the protected blocks
(sinks, recent window) plus the k_free unprotected blocks of highest Quest bound. Sharded, each rank sends the
k_free highest bounds of its own unprotected blocks per kv head ([kv heads, k_free] floats); every rank then
finds, per kv head, how many of the k_free globally highest bounds each rank holds, and a rank selects the
largest of its counts over the kv heads. So for top-K (Quest) the ranks' selections together contain, for every
kv head, the blocks one process holding the whole sequence selects: never less attended mass, at most
world_size * k_free unprotected blocks in all (exactly k_free with one kv head, or where the heads agree). No
floor is needed: a rank none of whose blocks rank among the k_free selects only its protected blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eviction import Policy, ScoreContext
from eviction.select import SeqWindow, all_blocks, cdiv, top_blocks


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Contiguous, block-aligned ranges of one sequence: rank r holds blocks [starts[r], starts[r + 1]) and the
    last rank everything from starts[-1] on (the tail, and so every appended token)."""

    block_tokens: int
    starts: tuple[int, ...]  # first block of each rank: starts[0] == 0, strictly increasing

    def __post_init__(self) -> None:
        if isinstance(self.block_tokens, bool) or not isinstance(self.block_tokens, int) or self.block_tokens < 1:
            raise ValueError(f"block_tokens must be an int >= 1, got {self.block_tokens!r}")
        s = self.starts
        if not s or s[0] != 0 or any(not isinstance(b, int) or b <= a for a, b in zip(s, s[1:])):
            raise ValueError(f"starts must begin at 0 and strictly increase, got {s!r}")

    @staticmethod
    def split(num_tokens: int, world_size: int, block_tokens: int) -> ShardPlan:
        """The blocks of a num_tokens prefill in world_size ranges as even as whole blocks allow."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        num_blocks = cdiv(num_tokens, block_tokens)
        if num_blocks < world_size:
            raise ValueError(f"{num_tokens} tokens are {num_blocks} blocks of {block_tokens}: fewer than the "
                             f"{world_size} ranks, each of which needs one")
        return ShardPlan(block_tokens, tuple(r * num_blocks // world_size for r in range(world_size)))

    @property
    def world_size(self) -> int:
        return len(self.starts)

    def token_range(self, rank: int) -> tuple[int, float]:
        """[start, end) of rank's tokens (end: inf for the last rank)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank!r}")
        end = self.starts[rank + 1] * self.block_tokens if rank + 1 < self.world_size else float("inf")
        return self.starts[rank] * self.block_tokens, end

    def owner(self, position: int) -> int:
        """The rank that holds the token at `position`."""
        return max(r for r, b in enumerate(self.starts) if b * self.block_tokens <= position)


def protected_blocks(window: SeqWindow, first_block: int, num_blocks: int, device: torch.device) -> torch.Tensor:
    """bool [num_blocks]: which blocks of a shard starting at global block first_block the whole sequence's
    `window` protects (its sinks and recent window; a shard's last block only if it is the sequence's)."""
    sink_blocks, recent_start = window.protected_range()
    blocks = torch.arange(first_block, first_block + num_blocks, device=device)  # [n] global indices
    return (blocks < sink_blocks) | (blocks >= recent_start)


def free_top(bounds: torch.Tensor, protected: torch.Tensor, k_free: int) -> torch.Tensor:
    """float32 [H, k_free]: per kv head the k_free highest `bounds` [H, n] of unprotected blocks, descending,
    -inf where the shard has fewer."""
    free = bounds.float().masked_fill(protected, float("-inf"))
    top = torch.topk(free, min(k_free, free.shape[1]), dim=1).values
    return F.pad(top, (0, k_free - top.shape[1]), value=float("-inf"))


def allot_free_blocks(gathered: torch.Tensor, k_free: int) -> torch.Tensor:
    """gathered [R, H, k_free] (every rank's free_top) -> int64 [R]: the unprotected blocks each rank selects,
    its largest count over kv heads of the k_free globally highest bounds it holds (the module's rule)."""
    num_ranks, num_heads, k = gathered.shape
    if k != k_free:
        raise ValueError(f"gathered must be [ranks, kv_heads, {k_free}], got {list(gathered.shape)}")
    if k_free == 0:
        return torch.zeros(num_ranks, dtype=torch.int64, device=gathered.device)
    flat = gathered.permute(1, 0, 2).reshape(num_heads, num_ranks * k_free)  # [H, R * k], rank-major
    owners = torch.topk(flat, k_free, dim=1).indices // k_free  # [H, k_free]
    counts = F.one_hot(owners, num_ranks).sum(1)  # [H, R]
    return counts.max(0).values


def free_to_select(window: SeqWindow, budget: int) -> int | None:
    """k_free: the unprotected blocks one process selects per kv head for `budget` tokens over the whole
    sequence's `window`; None when the budget covers every block (every rank then attends its whole shard)."""
    k_all = window.num_selected(budget)
    return None if k_all >= window.num_blocks else k_all - window.num_protected()


def shard_scores(topk: Policy, window: SeqWindow, first_block: int, summaries: torch.Tensor,
                 q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bounds float32 [H, n], protected bool [n]) of a shard's summaries [n, 2, H, D] starting at global block
    first_block: the Quest bound (`topk`, the store's top-K policy) of each block for q, comparable across ranks,
    which the budget rule ranks by whatever the mode; and which blocks the sequence's `window` protects."""
    n, bt = summaries.shape[0], window.block_tokens
    ctx = ScoreContext(summaries=summaries, window=SeqWindow(num_tokens=n * bt, block_tokens=bt), q=q)
    return topk.score(ctx), protected_blocks(window, first_block, n, summaries.device)


def select_shard(mode: str, policy: Policy, bounds: torch.Tensor, protected: torch.Tensor, extra: int,
                 q: torch.Tensor, summaries: torch.Tensor, sketch: torch.Tensor) -> torch.Tensor:
    """int64 [H, k] ascending: a shard's protected blocks plus `extra` others per kv head, the best by the mode's
    `policy` (topk: the Quest bound; sketch: the 4-bit key sketch's estimated mass, SketchTopK.select_masked)."""
    h, n = bounds.shape
    k = int(protected.sum()) + extra
    if k == 0:
        return torch.empty((h, 0), dtype=torch.int64, device=bounds.device)
    if k >= n:
        return all_blocks(h, n, bounds.device)
    if mode == "topk":
        return top_blocks(bounds.masked_fill(protected, float("inf")), k)
    valid = torch.ones(n, dtype=torch.bool, device=bounds.device)
    return policy.select_masked(q, summaries, sketch, valid, protected, k)[0]
