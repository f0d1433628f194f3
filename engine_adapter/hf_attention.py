"""kvtier as a transformers attention implementation: an unmodified HF Llama-family model decodes
straight from the store's pools with kvtier's dense / topk / h2o / window modes, one store sequence per
batch row.

    from engine_adapter.hf_attention import register
    from engine_adapter.hf_cache import KVTierCache

    register()                                   # adds "kvtier" to transformers' attention and mask interfaces
    model.set_attn_implementation("kvtier")      # or from_pretrained(..., attn_implementation="kvtier")
    with KVTierCache(store, mode="topk", budget=512) as cache:
        out = model.generate(input_ids, attention_mask=mask, past_key_values=cache, max_new_tokens=32, do_sample=False)
        print(cache.decode_reads())              # K/V bytes the store's decode attention read per step

The model calls `cache.update(k, v, layer)` and then this function on what update() returned.
update() only stages the new K/V, tagged with its cache layer; this function checks what it was
given (engine_adapter/hf_masks.py: which queries are each row's tokens), then appends each row's tokens
to the row's sequence, so a refused step leaves the store as it was:
- decode (one query token per row): `store.attend(seq, layer, q, mode, budget)` for each row reads only the
  blocks the mode selects. Nothing is read back densely.
- prefill (many query tokens): per row, SDPA of the row's tokens over what its sequence held before the
  chunk (read back once per chunk, not per step) followed by the row's tokens of the chunk, causal.
A pad's query attends nothing: its output is zeros (no token of its row reads it).
"""

from __future__ import annotations

import torch
from torch import nn

from engine_adapter.hf_cache import NAME
from engine_adapter.hf_cache_layer import LAYER_ATTRIBUTE, KVTierLayer
from engine_adapter.hf_masks import kvtier_mask, real_queries
from engine_adapter.llama import chunk_attention

__all__ = ["NAME", "kvtier_attention", "kvtier_mask", "register"]


def register() -> None:
    """Make attn_implementation="kvtier" available to every transformers model (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(NAME, kvtier_attention)
    AttentionMaskInterface.register(NAME, kvtier_mask)


def kvtier_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: object) -> tuple[torch.Tensor, None]:
    """query [B, Hq, T, D], key/value [B, Hkv, T, D] as KVTierLayer.update returned them -> ([B, T, Hq, D], None)."""
    layer: KVTierLayer | None = getattr(key, LAYER_ATTRIBUTE, None)
    if layer is None:
        raise ValueError("attn_implementation='kvtier' needs a KVTierCache: pass "
                         "past_key_values=KVTierCache(store, ...) to generate() or forward()")
    try:
        _check(module, layer, dropout, kwargs)
        real = real_queries(attention_mask, layer.num_tokens, layer.num_columns, query.shape[2])  # [B, T] or None
    except ValueError:
        layer.discard()  # the store never sees this step's K/V
        raise
    held_before = list(layer.num_tokens)
    layer.commit(real)
    head_dim = query.shape[-1]
    if scaling is not None and scaling != head_dim**-0.5:  # the store and SDPA below scale by 1/sqrt(D)
        query = query * (scaling * head_dim**0.5)
    if query.shape[2] == 1:
        return _decode(layer, query, real), None
    return _prefill(layer, query, key, value, real, held_before), None


def _check(module: nn.Module, layer: KVTierLayer, dropout: float, kwargs: dict[str, object]) -> None:
    """Refuse what the store cannot attend exactly, before the layer's staged K/V are appended."""
    if dropout:
        raise ValueError(f"kvtier attention is for inference; got dropout={dropout} (call model.eval())")
    unsupported = {name: kwargs[name] for name in ("sliding_window", "softcap") if kwargs.get(name) is not None}
    if unsupported:  # Mistral-style windows, Gemma-style logit caps: the store attends plain softmax
        raise ValueError(f"kvtier attention supports full causal softmax attention only, got {unsupported}")
    _check_model(getattr(module, "config", None), layer.store.spec.num_layers)


def _check_model(config: object, num_store_layers: int) -> None:
    """Refuse a model whose layers the store cannot all hold and attend, from its config: every layer refuses
    alike, so the first one does and no layer's K/V are stored."""
    other_types = sorted(set(getattr(config, "layer_types", None) or ()) - {"full_attention"})
    if other_types:  # e.g. sliding-window layers after full ones: refused here rather than midway through a step
        raise ValueError(f"kvtier attention supports full causal attention in every layer; the model also has "
                         f"{other_types} layers")
    num_model_layers = getattr(config, "num_hidden_layers", None)
    if num_model_layers is not None and num_model_layers != num_store_layers:
        raise ValueError(f"the model has {num_model_layers} layers but the store holds {num_store_layers} "
                         f"(ModelSpec.num_layers): build the store for the model's {num_model_layers} layers")


def _decode(layer: KVTierLayer, query: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """One query per row [B, Hq, 1, D]: each row's token attends through its sequence -> [B, 1, Hq, D] in query's
    dtype (zeros for a pad)."""
    store = layer.store
    q = query[:, :, 0].to(store.device, torch.float16)  # [B, Hq, D]
    out = torch.zeros_like(q)
    for row, seq in enumerate(layer.seqs):
        if real is None or bool(real[row, 0]):
            out[row] = store.attend(seq, layer.layer, q[row], mode=layer.mode, budget=layer.budget)  # [Hq, D] fp16
            layer.attended()
    return out.to(query.device, query.dtype)[:, None]


def _prefill(layer: KVTierLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             real: torch.Tensor | None, held_before: list[int]) -> torch.Tensor:
    """A chunk of T queries per row: each row's tokens attend, causally, what its sequence held before the chunk
    (read from the store) and the row's tokens of the chunk (the model's own K/V) -> [B, T, Hq, D] (zeros for pads)."""
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])  # [B, T, Hq, D]
    as_model = dict(device=key.device, dtype=key.dtype)
    for row, seq in enumerate(layer.seqs):
        cols = slice(None) if real is None else real[row].to(query.device).nonzero()[:, 0]
        q, k, v = (x[row].transpose(0, 1)[cols] for x in (query, key, value))  # [t, H, D]
        if q.shape[0] == 0:
            continue
        if held_before[row]:
            old_k, old_v = layer.store.read(seq, layer.layer, 0, held_before[row])  # [S0, Hkv, D] fp16
            k, v = torch.cat([old_k.to(**as_model), k]), torch.cat([old_v.to(**as_model), v])
        out[row, cols] = chunk_attention(q, k, v, held_before[row])
    return out
