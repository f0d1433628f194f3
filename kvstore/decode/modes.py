"""The decode modes a store serves, the policy each one names, and the checks of a decode query and its K/V.

    dense    every block (no policy)
    topk     Quest's min/max bound (TopK)                      window   sinks + newest blocks (Window)
    sketch   the 4-bit key sketch (SketchTopK)                 h2o      drop mode (H2O)
    cascade  Quest's candidates reranked by 4-bit codes (CascadeTopK)
A mode may also be a policy instance whose fields are its settings. sketch and cascade read the blocks'
4-bit key codes, which a store keeps only with Config.sketch_codes.
"""

from __future__ import annotations

import math

import torch

from eviction import CascadeTopK, Policy, SketchTopK
from kvstore.config import ModelSpec

MODES = ("dense", "topk", "sketch", "cascade", "h2o", "window")
CODE_MODES = ("sketch", "cascade")  # the modes that read the blocks' 4-bit key codes


def reads_codes(mode: str | Policy | None) -> bool:
    return mode in CODE_MODES if isinstance(mode, str) else isinstance(mode, (SketchTopK, CascadeTopK))


def resolve_policy(mode: str | Policy, policies: dict[str, Policy], sketch_codes: bool) -> Policy | None:
    """The policy of `mode` (None: dense); ValueError for an unknown mode or one that reads codes the store
    does not keep."""
    if reads_codes(mode) and not sketch_codes:
        raise ValueError(f"mode={mode!r} reads sketch codes, and this store has none (Config.sketch_codes=False)")
    if isinstance(mode, Policy):
        return mode
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} or an eviction.Policy instance, got {mode!r}")
    return None if mode == "dense" else policies[mode]


def check_query(q: torch.Tensor, budget: int, spec: ModelSpec, device: torch.device) -> None:
    """ValueError unless q is float16 [num_q_heads, head_dim] on `device` and budget a positive int."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"budget must be a positive int (tokens), got {budget!r}")
    shape = (spec.num_q_heads, spec.head_dim)
    if not isinstance(q, torch.Tensor) or tuple(q.shape) != shape or q.dtype != torch.float16 \
            or q.device.type != device.type:
        got = f"{q.dtype} {list(q.shape)} on {q.device}" if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must be float16 {list(shape)} on {device.type}, got {got}")


def check_kv(k: torch.Tensor, v: torch.Tensor, spec: ModelSpec, device: torch.device) -> None:
    """ValueError unless k and v are finite float16 [T > 0, num_kv_heads, head_dim] of one shape on `device`."""
    h, d = spec.num_kv_heads, spec.head_dim
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3 or t.shape[1:] != (h, d) or t.shape[0] == 0:
            raise ValueError(f"{name} must have shape [T>0, {h}, {d}], got {list(t.shape)}")
        if t.dtype != torch.float16:
            raise ValueError(f"{name} must be torch.float16, got {t.dtype}")
        if t.device.type != device.type:
            raise ValueError(f"{name} must be on {device.type}, got {t.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
    # int8 scales would spread a NaN/Inf. One fp32 sum a tensor (a finite fp16 sum cannot overflow fp32; a NaN
    # or Inf reaches it): three launches and the one host sync a store.append costs
    if not math.isfinite(float(k.sum(dtype=torch.float32) + v.sum(dtype=torch.float32))):
        raise ValueError("k and v must be finite: NaN or Inf found (nothing was stored)")
