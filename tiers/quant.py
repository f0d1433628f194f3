"""KIVI-style int8: K quantized per channel, V per token, symmetric absmax scales.

Within one block, K's scale is shared by the block's tokens for each (head, channel),
which tracks K's outlier channels; V's scale is shared by the channels of each
(head, token). Error bound, elementwise: |x - dequant(quant(x))| <= scale / 2 with
scale = absmax / 127 over the group, i.e. at most absmax / 254 of the group's
largest magnitude (0.4%). Rounding to nearest makes the bound tight.
"""

from __future__ import annotations

import torch

from tiers.layout import Blocks, Int8Blocks

_TINY = 1e-8  # keeps all-zero groups finite


def quantize(blocks: torch.Tensor) -> Int8Blocks:
    """fp16 [n, 2, H, B, D] -> Int8Blocks."""
    x = blocks.float()
    k, v = x[:, 0], x[:, 1]  # [n, H, B, D]
    k_scale = k.abs().amax(dim=2).clamp_min(_TINY) / 127.0  # [n, H, D]
    v_scale = v.abs().amax(dim=3).clamp_min(_TINY) / 127.0  # [n, H, B]
    data = torch.empty(blocks.shape, dtype=torch.int8, device=blocks.device)
    data[:, 0] = torch.round(k / k_scale[:, :, None, :]).clamp_(-127, 127).to(torch.int8)
    data[:, 1] = torch.round(v / v_scale[:, :, :, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Blocks(data, k_scale, v_scale)


def dequantize(blocks: Int8Blocks) -> torch.Tensor:
    """Int8Blocks -> fp16 [n, 2, H, B, D]."""
    data = blocks.data.float()
    out = torch.empty(blocks.data.shape, dtype=torch.float16, device=blocks.data.device)
    out[:, 0] = data[:, 0] * blocks.k_scale[:, :, None, :]
    out[:, 1] = data[:, 1] * blocks.v_scale[:, :, :, None]
    return out


def error_bound(blocks: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |dequantize(quantize(x)) - x| for fp16 blocks, incl. the final fp16 rounding."""
    q = quantize(blocks)
    bound = torch.empty(blocks.shape, dtype=torch.float32, device=blocks.device)
    bound[:, 0] = q.k_scale[:, :, None, :] / 2
    bound[:, 1] = q.v_scale[:, :, :, None] / 2
    return bound + blocks.float().abs() * 2.0**-10 + 1e-7


def sequence_error_bound(k: torch.Tensor, v: torch.Tensor, block_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise bounds on what int8 storage may change in k, v [T, H, D], blocked as the store blocks them."""
    t, h, d = k.shape
    n = -(-t // block_tokens)
    pad = n * block_tokens - t
    kv = torch.stack([torch.cat([x, x.new_zeros(pad, h, d)]) for x in (k, v)])  # [2, n*B, H, D]
    blocks = kv.view(2, n, block_tokens, h, d).permute(1, 0, 3, 2, 4).contiguous()  # [n, 2, H, B, D]
    bound = error_bound(blocks).permute(1, 0, 3, 2, 4).reshape(2, -1, h, d)[:, :t]
    return bound[0], bound[1]


def within_bound(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
                 block_tokens: int) -> bool:
    """True if stored-and-read-back (k, v) differ from the originals by no more than int8 allows."""
    bounds = sequence_error_bound(*want, block_tokens)
    return all(bool(((g.float() - w.float()).abs() <= b).all()) for g, w, b in zip(got, want, bounds))


def one_format(parts: list[Blocks]) -> list[Blocks]:
    """Batches of one format as they are; a mix of fp16 and int8 comes back all fp16 (int8 ones
    dequantized), so a cold tier can hold blocks in whatever format they arrived in."""
    if len({isinstance(p, Int8Blocks) for p in parts}) <= 1:
        return parts
    return [dequantize(p) if isinstance(p, Int8Blocks) else p for p in parts]
