"""kvtier as a transformers attention implementation: an unmodified HF Llama-family model decodes
straight from the store's pools with kvtier's dense / topk / h2o / window modes.

    from engine_adapter.hf_attention import register
    from engine_adapter.hf_cache import KVTierCache

    register()                                   # adds "kvtier" to transformers' AttentionInterface
    model.set_attn_implementation("kvtier")      # or from_pretrained(..., attn_implementation="kvtier")
    with KVTierCache(store, mode="topk", budget=512) as cache:
        out = model.generate(input_ids, cache=cache, max_new_tokens=32, do_sample=False)
        print(cache.decode_reads())              # K/V bytes the store's decode attention read per step

The model calls `cache.update(k, v, layer)` and then this function on what update() returned:
- decode (one query token): update() appended the token's K/V to the store and returned it tagged
  with its cache layer; this function runs `store.attend(seq, layer, q, mode, budget)`, which reads
  only the blocks the mode selects. Nothing is read back densely.
- prefill (many query tokens): update() returned the chunk's own K/V after whatever the store held
  before it (read back once per chunk, not per step); SDPA runs over them, causal from the chunk's
  first position.
No attention mask function is registered, so transformers builds none: batch size 1, no padding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine_adapter.llama import chunk_attention

if TYPE_CHECKING:
    from engine_adapter.hf_cache import KVTierLayer

NAME = "kvtier"
LAYER_ATTRIBUTE = "kvtier_layer"  # set by KVTierLayer.update on the key tensor it returns


def register() -> None:
    """Make attn_implementation="kvtier" available to every transformers model (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, kvtier_attention)


def kvtier_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: object) -> tuple[torch.Tensor, None]:
    """query [1, Hq, T, D], key/value as KVTierLayer.update returned them -> ([1, T, Hq, D], None)."""
    layer: KVTierLayer | None = getattr(key, LAYER_ATTRIBUTE, None)
    if layer is None:
        raise ValueError("attn_implementation='kvtier' needs a KVTierCache: pass cache=KVTierCache(store, ...) "
                         "to generate() or forward()")
    if dropout:
        raise ValueError(f"kvtier attention is for inference; got dropout={dropout} (call model.eval())")
    unsupported = {name: kwargs[name] for name in ("sliding_window", "softcap") if kwargs.get(name) is not None}
    if unsupported:  # Mistral-style windows, Gemma-style logit caps: the store attends plain softmax
        raise ValueError(f"kvtier attention supports full causal softmax attention only, got {unsupported}")
    head_dim = query.shape[-1]
    if scaling is not None and scaling != head_dim**-0.5:  # the store and SDPA below scale by 1/sqrt(D)
        query = query * (scaling * head_dim**0.5)
    if query.shape[2] == 1:
        return _decode(layer, query), None
    start = key.shape[2] - query.shape[2]  # tokens the store held before this chunk
    out = chunk_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), start)
    return out[None], None  # [1, T, Hq, D]


def _decode(layer: KVTierLayer, query: torch.Tensor) -> torch.Tensor:
    """One query token [1, Hq, 1, D] attends through the store -> [1, 1, Hq, D] in query's dtype."""
    store = layer.store
    q = query[0, :, 0].to(store.device, torch.float16)  # [Hq, D]
    out = store.attend(layer.seq, layer.layer, q, mode=layer.mode, budget=layer.budget)  # [Hq, D] fp16
    layer.attended()
    return out.to(query.device, query.dtype)[None, None]
