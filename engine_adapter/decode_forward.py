"""One decode token of a batch of rows through the model: the forward a captured decode graph records.

embedding -> every layer (q/k/v projections of the B tokens, attention through the store's step: a BatchStep,
each sequence's append, select and H2O accounting around one paged-attention launch, or a SlotBatch, the same
over rows that sequences join and leave; output projection and MLP) -> logits [B, vocab]. RoPE positions are
the step's device token counts, so nothing is re-captured as sequences grow. Each layer's last residual add is
deferred into the next layer's input norm (one fused add+RMSNorm launch on CUDA, as vLLM does).
"""

from __future__ import annotations

import torch

from engine_adapter.llama import Llama
from kvstore.decode.batch import BatchStep
from kvstore.decode.batch_slots import SlotBatch


@torch.no_grad()
def decode_logits(model: Llama, step: BatchStep | SlotBatch, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 logits [B, vocab] of each row's token (tokens int64 [B]) at its next position, appending K/V in
    every layer. Device work only: capturable."""
    dtype = model.embed_tokens.weight.dtype
    cos, sin = model.rope(step.token_positions(), dtype)  # [B, D] each, from device state
    x, delta = model.embed_tokens(tokens), None  # [B, dim]; delta: the MLP output not yet in x
    for i, layer in enumerate(model.layers):
        q, k, v = layer.qkv(x, cos, sin, delta)  # [B, Hq, D], [B, H, D], [B, H, D]; x += delta first
        attn = step.attend(i, q.half(), k.half(), v.half())  # [B, Hq, D]
        x, delta = layer.finish_deferred(x, attn)
    return model.logits(x, delta)
