"""StreamingLLM: attention sinks plus a recent window (Xiao et al. 2023,
"Efficient Streaming Language Models with Attention Sinks").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eviction.policy import Policy, ScoreContext


@dataclass
class Window(Policy):
    """Scores each block by its position, so `select` keeps the sinks and the newest blocks.

    With a budget no larger than the protected set this is exactly sinks + recent
    window; a larger budget widens the window towards the past (StreamingLLM with a
    cache of `budget_tokens`) instead of picking scattered blocks. Query and
    attention history are ignored, and every kv head gets the same blocks.
    """

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        position = torch.arange(ctx.num_blocks, device=ctx.device, dtype=torch.float32)  # [N]
        return position.expand(ctx.num_kv_heads, ctx.num_blocks)  # [H, N]
