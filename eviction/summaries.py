"""Block summaries: per block and kv head, the elementwise min and max of its keys.

fp16 summaries are exact. `summaries_to_fp8` halves their bytes (the bytes a sparse
step mostly reads at long context) and keeps Quest's bound an upper bound by
rounding minima down and maxima up (directed rounding, one e4m3 step at most);
the price is a looser bound, i.e. a slightly blunter ranking.
"""

from __future__ import annotations

import torch

from eviction.select import cdiv

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn


def summarize_keys(keys: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """keys [T, kv_heads, head_dim] -> float16 [ceil(T / block_tokens), 2, kv_heads, head_dim].

    The last block may be partial: it summarizes only its real tokens.
    """
    if keys.dim() != 3 or keys.shape[0] < 1:
        raise ValueError(f"keys: expected [T >= 1, kv_heads, head_dim], got {list(keys.shape)}")
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    num_tokens, num_kv_heads, head_dim = keys.shape
    num_blocks = cdiv(num_tokens, block_tokens)
    padded = keys.new_empty(num_blocks * block_tokens, num_kv_heads, head_dim)  # [N*B, H, D]
    padded[:num_tokens] = keys
    padded[num_tokens:] = keys[-1]  # repeating a real key leaves min and max unchanged
    blocks = padded.view(num_blocks, block_tokens, num_kv_heads, head_dim)  # [N, B, H, D]
    return torch.stack((blocks.amin(1), blocks.amax(1)), dim=1).to(torch.float16)  # [N, 2, H, D]


def _step(bits: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Move e4m3fn bit patterns one step toward +inf (up) or -inf (~up). Sign-magnitude order."""
    negative = bits >= 0x80
    magnitude = bits & 0x7F
    away_from_zero = up ^ negative  # up on a positive, down on a negative: magnitude grows
    grown = bits + 1
    past_zero = torch.where(up, torch.full_like(bits, 0x01), torch.full_like(bits, 0x81))  # from +-0
    shrunk = torch.where(magnitude == 0, past_zero, bits - 1)
    return torch.where(away_from_zero, grown, shrunk)


def summaries_to_fp8(summaries: torch.Tensor) -> torch.Tensor:
    """float16 [N, 2, H, D] -> float8_e4m3fn [N, 2, H, D] with min rounded down and max rounded up.

    Keys must lie within +-448 (e4m3fn has no infinity to round to); otherwise ValueError.
    """
    if summaries.dim() != 4 or summaries.shape[1] != 2 or summaries.dtype != torch.float16:
        raise ValueError(f"summaries: expected float16 [N, 2, H, D], got {summaries.dtype} {list(summaries.shape)}")
    x = summaries.float()
    largest = float(x.abs().amax()) if x.numel() else 0.0
    if largest > FP8_MAX:
        raise ValueError(f"summaries: fp8 e4m3 needs |key| <= {FP8_MAX}, got {largest}")
    nearest = x.to(FP8)
    back = nearest.float()
    up = torch.zeros_like(x, dtype=torch.bool)
    up[:, 1] = True  # index 1 holds maxima: round up; index 0 minima: round down
    wrong_way = torch.where(up, back < x, back > x)
    bits = nearest.view(torch.uint8).to(torch.int16)
    fixed = torch.where(wrong_way, _step(bits, up), bits)
    return fixed.to(torch.uint8).view(FP8)
