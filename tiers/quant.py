"""KIVI-style quantized blocks: K quantized per channel, V per token, in one of three formats.

int8  symmetric absmax scales (f32): K's scale is shared by the block's tokens for each (head,
      channel), which tracks K's outlier channels; V's by the channels of each (head, token).
      |x - dequant(quant(x))| <= scale / 2 with scale = absmax / 127 over the group (0.4% of it).
fp8   e4m3 (3 mantissa bits) over the same scales, absmax / 448, stored as uint8 bit patterns so
      every tier and the decode kernel move and decode them with integer ops. The relative error
      is <= 2^-4 (round to nearest), or scale * 2^-10 in e4m3's subnormals.
int4  asymmetric: code = round((x - min) / scale) in [0, 15], scale = (max - min) / 15, per channel
      over groups of gk tokens for K and per token over groups of gv channels for V (KIVI), two codes
      a byte. (scale, zero = min) are kept in fp16, and codes are taken against the fp16 values, so
      |x - dequant(quant(x))| <= scale / 2 up to their rounding. 3.2x smaller than fp16 at 32-token
      blocks of head_dim 128 (int8: 1.86x).
Shapes: tiers/layout.py.
"""

from __future__ import annotations

import torch

from tiers.layout import QUANT_FORMATS, Blocks, QuantBlocks, format_of

_TINY = 1e-8  # keeps all-zero groups finite
FP8_MAX = 448.0  # the largest finite e4m3 value


def quantize(blocks: torch.Tensor, fmt: str = "int8", int4_group: int = 32) -> QuantBlocks:
    """fp16 [n, 2, H, B, D] -> QuantBlocks in `fmt` (int4_group: int4's group, tiers/layout.py)."""
    if fmt == "int4":
        return _quantize_int4(blocks, int4_group)
    if fmt not in ("int8", "fp8"):
        raise ValueError(f"quantize: fmt must be one of {QUANT_FORMATS}, got {fmt!r}")
    x = blocks.float()
    k, v = x[:, 0], x[:, 1]  # [n, H, B, D]
    top = 127.0 if fmt == "int8" else FP8_MAX
    k_scale = k.abs().amax(dim=2).clamp_min(_TINY) / top  # [n, H, D]
    v_scale = v.abs().amax(dim=3).clamp_min(_TINY) / top  # [n, H, B]
    ks, vs = k / k_scale[:, :, None, :], v / v_scale[:, :, :, None]
    if fmt == "int8":
        data = torch.stack([torch.round(t).clamp_(-127, 127) for t in (ks, vs)], dim=1).to(torch.int8)
    else:
        data = torch.stack([t.clamp(-FP8_MAX, FP8_MAX) for t in (ks, vs)], dim=1)
        data = data.to(torch.float8_e4m3fn).view(torch.uint8)
    return QuantBlocks(data, k_scale, v_scale)


def _quantize_int4(blocks: torch.Tensor, group: int) -> QuantBlocks:
    n, _, h, b, d = blocks.shape
    gk, gv = min(group, b), min(group, d)
    x = blocks.float()
    k = x[:, 0].view(n, h, b // gk, gk, d)  # groups of gk tokens per channel
    v = x[:, 1].view(n, h, b, d // gv, gv)  # groups of gv channels per token
    k_codes, k_params = _int4_codes(k, dim=3)
    v_codes, v_params = _int4_codes(v, dim=4)
    codes = torch.stack([k_codes.view(n, h, b, d), v_codes.view(n, h, b, d)], dim=1)  # [n, 2, H, B, D] in 0..15
    data = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # [n, 2, H, B, D // 2]
    return QuantBlocks(data, k_params, v_params)


def _int4_codes(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (int32, x's shape) of x over groups along `dim`, and (scale, zero) fp16 [n, 2, ...the rest]."""
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(_TINY).half().float()  # codes are taken against what is stored
    zero = lo.half().float()
    codes = torch.round((x - zero) / scale).clamp_(0, 15).to(torch.int32)
    params = torch.stack([scale.squeeze(dim), zero.squeeze(dim)], dim=1).half()
    return codes, params


def dequantize(blocks: QuantBlocks, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """QuantBlocks -> fp16 (or `dtype`: float32 skips the final rounding) [n, 2, H, B, D]."""
    fmt = blocks.fmt
    if fmt == "int4":
        return _dequantize_int4(blocks).to(dtype)  # float32 until here
    data = blocks.data.float() if fmt == "int8" else blocks.data.view(torch.float8_e4m3fn).float()
    out = torch.empty(blocks.data.shape, dtype=dtype, device=blocks.data.device)
    out[:, 0] = data[:, 0] * blocks.k_scale[:, :, None, :]
    out[:, 1] = data[:, 1] * blocks.v_scale[:, :, :, None]
    return out


def _dequantize_int4(blocks: QuantBlocks) -> torch.Tensor:
    n, _, h, b, half = blocks.data.shape
    d = 2 * half
    packed = blocks.data.to(torch.int32)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(n, 2, h, b, d).float()
    kp, vp = blocks.k_scale.float(), blocks.v_scale.float()  # [n, 2, H, B // gk, D], [n, 2, H, B, D // gv]
    gk, gv = b // kp.shape[3], d // vp.shape[4]
    k_scale, k_zero = (t.repeat_interleave(gk, dim=2) for t in (kp[:, 0], kp[:, 1]))  # [n, H, B, D]
    v_scale, v_zero = (t.repeat_interleave(gv, dim=3) for t in (vp[:, 0], vp[:, 1]))
    return torch.stack([codes[:, 0] * k_scale + k_zero, codes[:, 1] * v_scale + v_zero], dim=1)


def error_bound(blocks: torch.Tensor, fmt: str = "int8", int4_group: int = 32) -> torch.Tensor:
    """Elementwise bound on |dequantize(quantize(x)) - x| for fp16 blocks, incl. the final fp16 rounding."""
    q = quantize(blocks, fmt, int4_group)
    x = blocks.float()
    bound = torch.empty(blocks.shape, dtype=torch.float32, device=blocks.device)
    if fmt == "int8":
        bound[:, 0] = q.k_scale[:, :, None, :] / 2
        bound[:, 1] = q.v_scale[:, :, :, None] / 2
    elif fmt == "fp8":
        bound[:, 0] = q.k_scale[:, :, None, :] * 2.0**-10
        bound[:, 1] = q.v_scale[:, :, :, None] * 2.0**-10
        bound = torch.maximum(bound, x.abs() * 2.0**-4)
    else:
        n, _, h, b, d = blocks.shape
        kp, vp = q.k_scale.float(), q.v_scale.float()
        gk, gv = b // kp.shape[3], d // vp.shape[4]
        bound[:, 0] = kp[:, 0].repeat_interleave(gk, dim=2) / 2
        bound[:, 1] = vp[:, 0].repeat_interleave(gv, dim=3) / 2
    return bound * (1 + 2.0**-10) + x.abs() * 2.0**-10 + 1e-7


def sequence_error_bound(k: torch.Tensor, v: torch.Tensor, block_tokens: int, fmt: str = "int8",
                         int4_group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise bounds on what `fmt` storage may change in k, v [T, H, D], blocked as the store blocks them."""
    t, h, d = k.shape
    n = -(-t // block_tokens)
    pad = n * block_tokens - t
    # padding repeats the last token, so that it widens no group's range (an int4 zero point would move)
    kv = torch.stack([torch.cat([x, x[-1:].expand(pad, h, d)]) for x in (k, v)])  # [2, n*B, H, D]
    blocks = kv.view(2, n, block_tokens, h, d).permute(1, 0, 3, 2, 4).contiguous()  # [n, 2, H, B, D]
    bound = error_bound(blocks, fmt, int4_group).permute(1, 0, 3, 2, 4).reshape(2, -1, h, d)[:, :t]
    return bound[0], bound[1]


def within_bound(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
                 block_tokens: int, fmt: str = "int8", int4_group: int = 32) -> bool:
    """True if stored-and-read-back (k, v) differ from the originals by no more than `fmt` allows."""
    bounds = sequence_error_bound(*want, block_tokens, fmt, int4_group)
    return all(bool(((g.float() - w.float()).abs() <= b).all()) for g, w, b in zip(got, want, bounds))


def to_format(blocks: Blocks, fmt: str, int4_group: int = 32) -> Blocks:
    """`blocks` in `fmt` ("float16" or one of QUANT_FORMATS): as they are when already in it; a quantized
    batch of another format is dequantized first (its error and the new one add up)."""
    have = format_of(blocks)
    if have == fmt:
        return blocks
    fp16 = dequantize(blocks) if have != "float16" else blocks
    return fp16 if fmt == "float16" else quantize(fp16, fmt, int4_group)


def one_format(parts: list[Blocks]) -> list[Blocks]:
    """Batches of one format as they are; a mix comes back all fp16 (quantized ones dequantized), so a cold
    tier can hold blocks in whatever format they arrived in."""
    if len({format_of(p) for p in parts}) <= 1:
        return parts
    return [dequantize(p) if isinstance(p, QuantBlocks) else p for p in parts]
