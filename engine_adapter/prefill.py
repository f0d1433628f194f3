"""Layer-wise prefill of a Llama (engine_adapter/llama.py) against a KVStore: the Decoder's prefill.

Per layer, the prompt's causal attention runs with SDPA over its K/V on the device (the sequence's
earlier tokens read from the store once, up front), queries and the MLP chunk_tokens at a time, then
the prompt's K/V are appended to the store (placed by tier), at most APPEND_TOKENS at a time. K/V
are rounded to fp16 before anyone attends to them: exactly what decode later reads back.
"""

from __future__ import annotations

import torch

from engine_adapter.llama import Llama, chunk_attention
from kvstore.store import KVStore

APPEND_TOKENS = 1 << 16  # prefill appends a layer's K/V to the store this many tokens at a time


@torch.no_grad()  # not inference_mode: tensors the store allocates here must stay writable after
def prefill_hidden(model: Llama, store: KVStore, seq: int, ids: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Layer-wise prefill of ids [T] after the sequence's tokens; returns the last layer's hidden [T, dim]."""
    a, start, t = model.args, store.table(seq, 0).num_tokens, ids.numel()
    device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    cos, sin = model.rope(torch.arange(start, start + t, device=device), dtype)  # [T, D]
    x = model.embed_tokens(ids)  # [T, dim]
    for i, layer in enumerate(model.layers):
        keys = torch.empty((start + t, a.num_kv_heads, a.head_dim), dtype=dtype, device=device)
        values = torch.empty_like(keys)  # [S, Hkv, D] for positions 0..start+T-1
        if start:
            keys[:start], values[:start] = store.read(seq, i)
        for lo in range(0, t, chunk_tokens):
            hi = min(t, lo + chunk_tokens)
            q, k, v = layer.qkv(x[lo:hi], cos[lo:hi], sin[lo:hi])
            keys[start + lo: start + hi], values[start + lo: start + hi] = k.half(), v.half()
            attn = chunk_attention(q, keys[: start + hi], values[: start + hi], start + lo)
            x[lo:hi] = layer.finish(x[lo:hi], attn)
        for lo in range(start, start + t, APPEND_TOKENS):  # bounded staging in the store's append
            hi = min(start + t, lo + APPEND_TOKENS)
            store.append(seq, i, keys[lo:hi].half(), values[lo:hi].half())
    return x
