"""The one budgeted selection every policy shares.

Given per-block scores of one sequence and layer, keep per kv head the protected
blocks (attention sinks and the recent window, always including the partial tail
block) plus the highest-scoring others, up to a token budget counted in whole
blocks. Rows come back sorted ascending so the tail block is last: the paged
decode kernel masks only the last entry of a block table as partial.

Everything here is sync-free on CUDA: counts are Python ints, tensors stay on
the scores' device, so `select` can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eviction.topk_kernel import FASTER_THAN_TORCH, can_select, topk_sorted, two_stage


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True, kw_only=True)
class SeqWindow:
    """One sequence's length in blocks and the blocks every selection keeps: the sinks (first sink_tokens)
    and the recent window (last recent_tokens, always the partial tail block). Checked once, here."""

    num_tokens: int
    block_tokens: int
    sink_tokens: int = 0
    recent_tokens: int = 0

    def __post_init__(self) -> None:
        for name, low in (("num_tokens", 1), ("block_tokens", 1), ("sink_tokens", 0), ("recent_tokens", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")

    @property
    def num_blocks(self) -> int:
        return cdiv(self.num_tokens, self.block_tokens)

    def protected_range(self) -> tuple[int, int]:
        """(sink_blocks, recent_start): blocks [0, sink_blocks) and [recent_start, num_blocks) are protected.

        Sinks are the first ceil(sink_tokens / block_tokens) blocks; the recent window is
        every block holding one of the last recent_tokens tokens, and always the tail block.
        """
        num_blocks = self.num_blocks
        sink_blocks = min(cdiv(self.sink_tokens, self.block_tokens), num_blocks)
        recent_start = min(max(0, self.num_tokens - self.recent_tokens) // self.block_tokens, num_blocks - 1)
        return sink_blocks, recent_start

    def num_protected(self) -> int:
        sink_blocks, recent_start = self.protected_range()
        return sink_blocks + self.num_blocks - max(recent_start, sink_blocks)

    def num_selected(self, budget_tokens: int) -> int:
        """k, the blocks kept per kv head: max(protected, budget_tokens // block_tokens), at most num_blocks."""
        if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 0:
            raise ValueError(f"budget_tokens must be an int >= 0, got {budget_tokens!r}")
        return min(max(self.num_protected(), budget_tokens // self.block_tokens), self.num_blocks)

    def protected_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """bool [num_blocks]: True for sink and recent-window blocks."""
        sink_blocks, recent_start = self.protected_range()
        blocks = torch.arange(self.num_blocks, device=device)  # [N]
        return (blocks < sink_blocks) | (blocks >= recent_start)


def check_window(window: object) -> SeqWindow:
    """`window` itself; ValueError unless it is a SeqWindow."""
    if not isinstance(window, SeqWindow):
        raise ValueError(f"window: expected a SeqWindow, got {type(window).__name__}")
    return window


def all_blocks(num_kv_heads: int, num_blocks: int, device: torch.device | str) -> torch.Tensor:
    """int64 [kv_heads, num_blocks]: every block for every head (what a budget covering everything selects)."""
    return torch.arange(num_blocks, device=device).expand(num_kv_heads, num_blocks).contiguous()


def top_blocks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [H, k]: per row the k highest-scoring block indices, sorted ascending.

    Protected blocks must already score +inf and every other score must be below +inf.
    """
    num_kv_heads, num_blocks = scores.shape
    if k >= num_blocks:  # the budget covers everything: no top-k launch
        return all_blocks(num_kv_heads, num_blocks, scores.device)
    if scores.is_cuda and (num_blocks <= FASTER_THAN_TORCH or two_stage(num_blocks, k)) and can_select(num_blocks, k):
        return topk_sorted(scores, k)  # one or two launches instead of topk's radix passes + a sort
    chosen = torch.topk(scores, k, dim=1, sorted=False).indices  # [H, k]
    return torch.sort(chosen, dim=1).values


def select(scores: torch.Tensor, window: SeqWindow, budget_tokens: int) -> torch.Tensor:
    """int64 [kv_heads, k]: per kv head the protected blocks plus the best-scoring others, sorted ascending.

    scores: float [kv_heads, num_blocks], higher = keep. NaN counts as -inf; +inf
    on an unprotected block is clamped below the protected blocks' +inf, so the
    sinks and the recent window are kept whatever the scores say.
    """
    if scores.dim() != 2 or not scores.is_floating_point():
        got = f"{scores.dtype} {list(scores.shape)}"
        raise ValueError(f"scores: expected a float [kv_heads, num_blocks] tensor, got {got}")
    k = check_window(window).num_selected(budget_tokens)
    num_blocks = window.num_blocks
    if scores.shape[1] != num_blocks:
        raise ValueError(f"scores: expected {num_blocks} blocks for {window.num_tokens} tokens of "
                         f"{window.block_tokens}, got {scores.shape[1]}")
    if k >= num_blocks:
        return top_blocks(scores, k)
    finite = scores.float().nan_to_num(nan=float("-inf"), posinf=torch.finfo(torch.float32).max, neginf=float("-inf"))
    return top_blocks(finite.masked_fill(window.protected_mask(scores.device), float("inf")), k)
