"""Greedy decode of one sequence with each whole token captured as one CUDA graph.

embedding -> every layer (q/k/v projections, the store's DecodeStep: append the token's K/V,
select, paged attention, H2O accounting; output projection and MLP) -> logits. Every token is
appended to the store. A graph is captured once per DecodeStep phase ("dense" while the
sequence has at most k blocks, then "topk") and replayed for every later token; between
tokens the host only does the block-boundary work DecodeStep.begin_token names. The RoPE
position is the step's device token count, so nothing is re-captured as the sequence grows.
Each layer's last residual add is deferred into the next layer's input norm (one fused
add+RMSNorm launch on CUDA, as vLLM does).
On CPU the same forward runs eagerly (no graph).
"""

from __future__ import annotations

import torch

from engine_adapter.llama import Llama
from kvstore.decode.graphs import GraphedSteps
from kvstore.store import KVStore


class GraphDecoder:
    def __init__(self, model: Llama, store: KVStore, seq: int, mode: str = "topk", budget: int = 4096,
                 capacity_tokens: int | None = None) -> None:
        self.model, self.store, self.seq = model, store, seq
        self.step = store.decode_step(seq, mode=mode, budget=budget, capacity_tokens=capacity_tokens)
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.token = torch.zeros(1, dtype=torch.long, device=self.device)  # [1] the input token
        self.steps = GraphedSteps(self.step, self._forward)

    def ready(self) -> bool:
        """False when the next token must go the eager way (blocks the step cannot serve, or capacity reached)."""
        return self.step.ready()

    @torch.no_grad()
    def _forward(self) -> torch.Tensor:
        """fp32 logits [vocab] of one token at position step.num_tokens, appending its K/V in every layer."""
        cos, sin = self.model.rope(self.step.num_tokens, self.dtype)  # [1, D] each, from device state
        x, delta = self.model.embed_tokens(self.token), None  # [1, dim]; delta: the MLP output not yet in x
        for i, layer in enumerate(self.model.layers):
            q, k, v = layer.qkv(x, cos, sin, delta)  # [1, Hq, D], [1, H, D], [1, H, D]; x += delta first
            attn = self.step.attend(i, q[0].half(), k[0].half(), v[0].half())  # [Hq, D]
            x, delta = layer.finish_deferred(x, attn[None])
        return self.model.logits(x, delta)[0]

    def __call__(self, token: int | torch.Tensor) -> torch.Tensor:
        """Append `token` (an int, or an int64 [1] tensor on the device: no host sync, so the host can queue
        the next token before this one ran) at the sequence's next position; returns fp32 logits [vocab] (a
        buffer the next call overwrites on CUDA: clone or consume it first)."""
        if isinstance(token, torch.Tensor):
            self.token.copy_(token)
        else:
            self.token.fill_(token)
        return self.steps()
