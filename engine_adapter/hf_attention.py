"""kvtier as a transformers attention implementation: an unmodified HF Llama-family model decodes
straight from the store's pools with kvtier's dense / topk / h2o / window modes.

    from engine_adapter.hf_attention import register
    from engine_adapter.hf_cache import KVTierCache

    register()                                   # adds "kvtier" to transformers' attention and mask interfaces
    model.set_attn_implementation("kvtier")      # or from_pretrained(..., attn_implementation="kvtier")
    with KVTierCache(store, mode="topk", budget=512) as cache:
        out = model.generate(input_ids, cache=cache, max_new_tokens=32, do_sample=False)
        print(cache.decode_reads())              # K/V bytes the store's decode attention read per step

The model calls `cache.update(k, v, layer)` and then this function on what update() returned.
update() only stages the new K/V, tagged with its cache layer; this function checks what it was
given, then appends the staged K/V to the store, so a refused step leaves the store as it was:
- decode (one query token): `store.attend(seq, layer, q, mode, budget)` reads only the blocks the
  mode selects. Nothing is read back densely.
- prefill (many query tokens): update() returned the chunk's own K/V after whatever the store held
  before it (read back once per chunk, not per step); SDPA runs over them, causal from the chunk's
  first position.

Masks: the store holds one sequence per cache and attends every position it holds, so the only mask
it applies exactly is the causal one. The mask function registered beside the attention builds no
mask and refuses, before any layer runs, a 2-D attention_mask with zeros (padding) or a mask pattern
other than causal (sliding window, packed sequences, overlays). A 4-D mask the caller built reaches
the attention function as-is: it is accepted when it allows exactly the causal positions and refused
otherwise, before the layer's K/V go into the store.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine_adapter.hf_cache import LAYER_ATTRIBUTE, NAME, KVTierLayer
from engine_adapter.llama import chunk_attention

SUPPORTED_MASKS = "no mask, an all-ones 2-D attention_mask, or a 4-D mask that allows exactly the causal positions"


def register() -> None:
    """Make attn_implementation="kvtier" available to every transformers model (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(NAME, kvtier_attention)
    AttentionMaskInterface.register(NAME, kvtier_mask)


def kvtier_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None,
                **kwargs: object) -> None:
    """transformers' mask builder for "kvtier", run once per forward before any layer: kvtier attention applies
    the causal mask itself, so build none; refuse padding and other mask patterns, which the store cannot apply."""
    from transformers.masking_utils import causal_mask_function

    if mask_function is not causal_mask_function:
        raise ValueError(f"kvtier attention applies a plain causal mask only ({SUPPORTED_MASKS}); the model asked "
                         f"for the mask pattern {getattr(mask_function, '__qualname__', mask_function)!r} "
                         "(a sliding window, packed sequences or an overlay)")
    if attention_mask is not None and not bool(attention_mask.all()):  # [B, S] bool, False = padding
        zeros = (~attention_mask.bool()).nonzero()[:, -1].tolist()
        shown = f"{zeros[:8]}{' ...' if len(zeros) > 8 else ''}"
        raise ValueError(f"kvtier attention supports {SUPPORTED_MASKS}: the store holds one sequence per cache and "
                         "attends every position in it, so padding cannot be left out; got a "
                         f"{list(attention_mask.shape)} attention_mask with {len(zeros)} zeros at positions {shown}. "
                         "Pass the prompt unpadded")


def kvtier_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: object) -> tuple[torch.Tensor, None]:
    """query [1, Hq, T, D], key/value as KVTierLayer.update returned them -> ([1, T, Hq, D], None)."""
    layer: KVTierLayer | None = getattr(key, LAYER_ATTRIBUTE, None)
    if layer is None:
        raise ValueError("attn_implementation='kvtier' needs a KVTierCache: pass cache=KVTierCache(store, ...) "
                         "to generate() or forward()")
    try:
        _check(module, layer, query.shape[2], attention_mask, dropout, kwargs)
    except ValueError:
        layer.discard()  # the store never sees this step's K/V
        raise
    layer.commit()
    head_dim = query.shape[-1]
    if scaling is not None and scaling != head_dim**-0.5:  # the store and SDPA below scale by 1/sqrt(D)
        query = query * (scaling * head_dim**0.5)
    if query.shape[2] == 1:
        return _decode(layer, query), None
    start = key.shape[2] - query.shape[2]  # tokens the store held before this chunk
    out = chunk_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), start)
    return out[None], None  # [1, T, Hq, D]


def _check(module: nn.Module, layer: KVTierLayer, num_queries: int, attention_mask: object, dropout: float,
           kwargs: dict[str, object]) -> None:
    """Refuse what the store cannot attend exactly, before the layer's staged K/V are appended."""
    if dropout:
        raise ValueError(f"kvtier attention is for inference; got dropout={dropout} (call model.eval())")
    unsupported = {name: kwargs[name] for name in ("sliding_window", "softcap") if kwargs.get(name) is not None}
    if unsupported:  # Mistral-style windows, Gemma-style logit caps: the store attends plain softmax
        raise ValueError(f"kvtier attention supports full causal softmax attention only, got {unsupported}")
    _check_model(getattr(module, "config", None), layer.store.spec.num_layers)
    _check_mask(attention_mask, num_queries, layer.num_tokens + num_queries)


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


def _check_mask(mask: object, num_queries: int, num_keys: int) -> None:
    """kvtier_mask builds no mask, so one that arrives was built 4-D by the caller: accept it only when it allows
    exactly the causal positions of the [num_queries, num_keys] block, which the store attends anyway."""
    if mask is None:
        return
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and tuple(mask.shape[-2:]) == (num_queries, num_keys):
        causal = torch.ones(num_queries, num_keys, dtype=torch.bool, device=mask.device).tril(num_keys - num_queries)
        if mask.dtype == torch.bool:
            allowed, blocked = mask, ~mask
        elif mask.is_floating_point():  # additive: 0 attends, -inf or the dtype's minimum blocks
            allowed, blocked = mask == 0, (mask == float("-inf")) | (mask == torch.finfo(mask.dtype).min)
        else:
            allowed = blocked = torch.zeros_like(causal)
        if bool((allowed | blocked).all()) and bool((allowed == causal).all()):
            return
    shape = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
    raise ValueError(f"kvtier attention supports {SUPPORTED_MASKS} over the {num_keys} positions the cache holds "
                     f"with this step's {num_queries}; got a {shape} attention mask that allows other positions "
                     "(padding or a custom pattern)")


def _decode(layer: KVTierLayer, query: torch.Tensor) -> torch.Tensor:
    """One query token [1, Hq, 1, D] attends through the store -> [1, 1, Hq, D] in query's dtype."""
    store = layer.store
    q = query[0, :, 0].to(store.device, torch.float16)  # [Hq, D]
    out = store.attend(layer.seq, layer.layer, q, mode=layer.mode, budget=layer.budget)  # [Hq, D] fp16
    layer.attended()
    return out.to(query.device, query.dtype)[None, None]
