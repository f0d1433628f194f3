"""The decode path: one query token attends over a sequence's blocks in one layer."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvstore.store import KVStore

MODES = ("dense", "topk", "h2o", "window")


def attend(store: KVStore, seq: int, layer: int, q: torch.Tensor, mode: str = "dense", budget: int = 4096) -> torch.Tensor:
    """q [num_q_heads, head_dim] -> attention output [num_q_heads, head_dim] (fp16)."""
    spec = store.spec
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(q, torch.Tensor) or q.shape != (spec.num_q_heads, spec.head_dim) or q.dtype != torch.float16:
        got = f"{q.dtype} {list(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must be float16 [{spec.num_q_heads}, {spec.head_dim}], got {got}")
    k, v = store.read(seq, layer)  # [T, H, D]
    if k.shape[0] == 0:
        raise ValueError(f"sequence {seq} layer {layer} holds no tokens to attend to")
    group = spec.num_q_heads // spec.num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)  # [T, Hq, D]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,thd->ht", q.float(), k) / math.sqrt(spec.head_dim)  # [Hq, T]
    return torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v).to(torch.float16)
