"""Token-level key sketch: every key quantized to 4 bits per channel, on the block's own min/max grid.

Quest's min/max bound sees a key only through extreme coordinates, so a key that points
along the query without being extreme anywhere ranks low (Twilight, Lin et al. 2025, and
Double Sparsity, Yang et al. 2024, score tokens from low-bit keys instead). The sketch
reuses the block summary (eviction/summaries.py) as its quantization grid, so it adds
only the codes: for block b, kv head h and channel d,
    step = (max_bd - min_bd) / 15,   code = round((k - min_bd) / step)  in [0, 15],
    k_hat = min_bd + step * code,    |k - k_hat| <= step / 2.

Layout: channel-major nibbles, so that a pass can read a few channels of every block (SparQ, Ribar et
al. 2023: eviction/sketch_channels.py) as whole 32-byte rows. For block b and kv head h the B * D / 2
bytes hold nibble i = d * B + t (channel d, token t) in byte i // 2, low nibble first: with an even
block size, channel d's row is bytes d * B/2 .. (d + 1) * B/2 - 1 and byte j holds tokens 2j (bits 0-3)
and 2j + 1 (bits 4-7). The tensor keeps the shape the store allocates and saves,
codes uint8 [num_blocks, kv_heads, 2, block_tokens, head_dim // 4] (B * D / 2 bytes per block and kv
head: `channel_rows` views it as [num_blocks, kv_heads, head_dim, block_tokens // 2]); only this module
writes or reads its bytes.
Bytes per token and kv head: head_dim / 2 (32 B at d64, 64 B at d128: 1/4 of the fp16 key,
1/8 of the fp16 K+V it describes), plus the summaries every block already has.

A partial tail block is re-encoded on every append against its running min/max (its
grid moves as tokens arrive); a full block's codes never change.
"""

from __future__ import annotations

import torch

from eviction.select import cdiv
from eviction.sketch_kernel import ROUNDING_SLACK, unpack_codes
from eviction.summaries import summarize_keys

LEVELS = 15  # 4-bit codes 0..15
FINE_HALF = 0.5  # 4-bit codes: |k - k_hat| <= step / 2
COARSE_MID, COARSE_HALF = 1.5, 2.0  # the top 2 bits alone (a 2-bit sketch): k_hat = min + step (4 (code >> 2) + 1.5) +- 2 step


def grid_steps(summaries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """summaries fp16 [..., 2, H, D] -> (min, step), float32 [..., H, D] each."""
    s = summaries.float()
    low = s.select(-3, 0)
    return low, (s.select(-3, 1) - low) / LEVELS


def pack(codes: torch.Tensor) -> torch.Tensor:
    """int codes [..., B, D] in [0, 15] -> uint8 [..., 2, B, D // 4]: channel-major nibbles (module docstring)."""
    b, d = codes.shape[-2:]
    nibbles = codes.transpose(-1, -2).reshape(*codes.shape[:-2], b * d // 2, 2)  # [..., B*D/2, 2]: (low, high)
    return (nibbles[..., 0] | (nibbles[..., 1] << 4)).to(torch.uint8).view(*codes.shape[:-2], 2, b, d // 4)


def unpack(packed: torch.Tensor, planes: int = 2) -> torch.Tensor:
    """uint8 [..., 2, B, D // 4] -> float32 [..., B, D]: the 4-bit code (planes=2) or its top 2 bits times 4
    (planes=1, a coarser estimate to compare with)."""
    code = unpack_codes(packed)
    return code if planes == 2 else torch.div(code, 4, rounding_mode="floor") * 4


def channel_rows(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2, B, D // 4] -> a view [..., D, B // 2]: row d holds channel d's codes, two tokens a byte."""
    b, d = codes.shape[-2], codes.shape[-1] * 4
    if b % 2:
        raise ValueError(f"channel rows need an even block size, got {b}")
    return codes.view(*codes.shape[:-3], d, b // 2)


def encode_blocks(blocks: torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
    """Codes of whole blocks: keys [n, B, H, D] on the grids of their summaries [n, 2, H, D]
    -> uint8 [n, H, 2, B, D // 4]. Tokens a block does not hold must repeat a real key or be masked later."""
    low, step = grid_steps(summaries)  # [n, H, D]
    scaled = (blocks.float() - low[:, None]) / torch.where(step > 0, step, torch.ones_like(step))[:, None]
    return pack(scaled.round().clamp_(0, LEVELS).to(torch.int64).transpose(1, 2))  # [n, H, 2, B, D/4]


def sketch_keys(keys: torch.Tensor, block_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [T, H, D] -> (summaries fp16 [N, 2, H, D], codes uint8 [N, H, 2, block_tokens, D // 4]).

    The tail block may be partial; its missing tokens get code 0 (never scored).
    """
    summaries = summarize_keys(keys, block_tokens)  # checks keys and block_tokens
    num_tokens, num_kv_heads, head_dim = keys.shape
    if head_dim % 4:
        raise ValueError(f"keys: head_dim must be a multiple of 4 for 2-bit planes, got {head_dim}")
    num_blocks = summaries.shape[0]
    padded = keys.new_empty(num_blocks * block_tokens, num_kv_heads, head_dim)  # [N*B, H, D]
    padded[:num_tokens] = keys
    padded[num_tokens:] = summaries[-1, 0]  # the tail's minimum: code 0
    return summaries, encode_blocks(padded.view(num_blocks, block_tokens, num_kv_heads, head_dim), summaries)


class KeySketch:
    """Summaries and codes of one sequence's keys in one layer, grown block by block or token by token.

    The tail block's raw keys are kept (block_tokens x H x D) so its codes can be redone against
    its growing min/max; everything else is the fixed-size sketch.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, block_tokens: int, device: torch.device | str = "cpu"):
        if block_tokens < 1 or head_dim % 4:
            raise ValueError(f"need block_tokens >= 1 and head_dim % 4 == 0, got {block_tokens}, {head_dim}")
        self.block_tokens = block_tokens
        self.num_tokens = 0
        self.summaries = torch.empty(0, 2, num_kv_heads, head_dim, dtype=torch.float16, device=device)
        self.codes = torch.empty(0, num_kv_heads, 2, block_tokens, head_dim // 4, dtype=torch.uint8, device=device)
        self.tail = torch.empty(0, num_kv_heads, head_dim, dtype=torch.float16, device=device)  # [t < B, H, D]

    @property
    def num_blocks(self) -> int:
        return cdiv(self.num_tokens, self.block_tokens)

    def append(self, keys: torch.Tensor) -> None:
        """Add keys [t, H, D] (fp16, RoPE applied) after the ones already sketched."""
        expected = tuple(self.summaries.shape[2:])
        if keys.dim() != 3 or tuple(keys.shape[1:]) != expected or keys.shape[0] < 1:
            raise ValueError(f"keys: expected [t >= 1, {expected[0]}, {expected[1]}], got {list(keys.shape)}")
        first_block = self.num_tokens // self.block_tokens  # the open tail block, or a new one
        pending = torch.cat((self.tail, keys.to(self.tail.dtype)))  # [tail + t, H, D]
        summaries, codes = sketch_keys(pending, self.block_tokens)
        self.summaries = torch.cat((self.summaries[:first_block], summaries))
        self.codes = torch.cat((self.codes[:first_block], codes))
        self.num_tokens += keys.shape[0]
        self.tail = pending[(pending.shape[0] // self.block_tokens) * self.block_tokens:]


def token_estimates_ref(q: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor,
                        planes: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(estimates float32 [Hq, N, B], error float32 [Hq, N]): per q head, token logit estimates q . k_hat
    and a bound on |q . k - q . k_hat| that holds for every token of the block.

    q: [Hq, D] (Hq a multiple of H: q head i reads kv head i // group); summaries [N, 2, H, D];
    codes [N, H, 2, B, D // 4]. planes=1 uses only the top 2 bits of each code (a 2-bit sketch, for comparison in
    bench_longctx/selection_quality.py).
    """
    num_kv_heads = summaries.shape[2]
    group = q.shape[0] // num_kv_heads
    low, step = grid_steps(summaries)  # [N, H, D]
    code = unpack(codes, planes) + (0.0 if planes == 2 else COARSE_MID)  # [N, H, B, D]
    qg = q.float().view(num_kv_heads, group, -1)  # [H, G, D]
    base = torch.einsum("hgd,nhd->hgn", qg, low)  # [H, G, N]
    qs = qg[:, :, None] * step.transpose(0, 1)[:, None]  # [H, G, N, D]
    est = base[..., None] + torch.einsum("hgnd,nhbd->hgnb", qs, code)  # [H, G, N, B]
    half = FINE_HALF if planes == 2 else COARSE_HALF
    magnitude = torch.maximum(low.abs(), (low + LEVELS * step).abs())  # [N, H, D]
    err = half * qs.abs().sum(-1) + ROUNDING_SLACK * torch.einsum("hgd,nhd->hgn", qg.abs(), magnitude)
    return est.flatten(0, 1), err.flatten(0, 1)


def token_mask(num_tokens: int, num_blocks: int, block_tokens: int, device: torch.device | str) -> torch.Tensor:
    """bool [N, B]: True for real tokens (the tail block may be partial)."""
    return torch.arange(num_blocks * block_tokens, device=device).view(num_blocks, block_tokens) < num_tokens
