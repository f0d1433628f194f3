"""What a selection policy sees, and the base every policy extends (kvpress style).

A policy is a dataclass whose fields are its hyperparameters; it writes only
`score()`. The shared `select()` in eviction/select.py turns scores into block
tables under a token budget and always keeps the sinks and the recent window.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from eviction.select import SeqWindow, check_window, select


@dataclass(slots=True)
class ScoreContext:
    """One sequence and layer at one decode step; every tensor on the store's device."""

    summaries: torch.Tensor  # float16 [num_blocks, 2, kv_heads, head_dim]: key min (0) and max (1) per block
    window: SeqWindow  # its tokens, block size, sinks and recent window
    q: torch.Tensor | None = None  # float16 [num_q_heads, head_dim], RoPE applied
    h2o_scores: torch.Tensor | None = None  # float32 [kv_heads, num_blocks], accumulated attention mass
    sketch: torch.Tensor | None = None  # uint8 [>= num_blocks, kv_heads, 2, block_tokens, head_dim // 4] (eviction/sketch.py)

    def __post_init__(self) -> None:
        w = check_window(self.window)
        s, n = self.summaries, w.num_blocks
        if not isinstance(s, torch.Tensor) or s.dim() != 4 or s.shape[0] != n or s.shape[1] != 2:
            got = f"{s.dtype} {list(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(
                f"summaries: expected [{n}, 2, kv_heads, head_dim] for {w.num_tokens} tokens, got {got}"
            )
        if self.q is not None and (self.q.dim() != 2 or self.q.shape[1] != s.shape[3]):
            raise ValueError(f"q: expected [num_q_heads, {s.shape[3]}], got {list(self.q.shape)}")
        if self.h2o_scores is not None and tuple(self.h2o_scores.shape) != (s.shape[2], n):
            raise ValueError(f"h2o_scores: expected [{s.shape[2]}, {n}], got {list(self.h2o_scores.shape)}")
        expected = (s.shape[2], 2, w.block_tokens, s.shape[3] // 4)
        if self.sketch is not None and (self.sketch.dim() != 5 or self.sketch.shape[0] < n
                                        or tuple(self.sketch.shape[1:]) != expected):
            raise ValueError(f"sketch: expected [>= {n}, {', '.join(map(str, expected))}], got {list(self.sketch.shape)}")

    @property
    def num_tokens(self) -> int:
        return self.window.num_tokens

    @property
    def num_blocks(self) -> int:
        return self.summaries.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.summaries.shape[2]

    @property
    def device(self) -> torch.device:
        return self.summaries.device


@dataclass
class Policy(ABC):
    """Base of every policy: subclasses implement `score`, the shared `select` does the rest."""

    @abstractmethod
    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """float32 [kv_heads, num_blocks]; higher = more worth keeping."""

    def select(self, ctx: ScoreContext, budget_tokens: int) -> torch.Tensor:
        """int64 [kv_heads, k], rows sorted ascending (tail block last): the blocks to attend."""
        return select(self.score(ctx), ctx.window, budget_tokens)
