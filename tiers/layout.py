"""What a block looks like in memory, in every tier.

A block is `block_tokens` consecutive tokens of one sequence in one layer, K and V of
all kv heads. Tiers move blocks in batches:

    fp16 batch : torch.float16 [n, 2, kv_heads, block_tokens, head_dim]   (index 0 = K, 1 = V)
    quantized  : QuantBlocks(data, k_scale, v_scale), one of QUANT_FORMATS (tiers/quant.py quantizes):
      int8  data int8  [n, 2, H, B, D]       k_scale f32 [n, H, D] K per channel, v_scale f32 [n, H, B] V per token
      fp8   data uint8 [n, 2, H, B, D]       e4m3 bit patterns; k_scale, v_scale as int8's
      int4  data uint8 [n, 2, H, B, D // 2]  two codes a byte (channel 2j low nibble, 2j + 1 high);
            k_scale f16 [n, 2, H, B // gk, D] (scale, zero) of K per channel over groups of gk tokens,
            v_scale f16 [n, 2, H, B, D // gv] (scale, zero) of V per token over groups of gv channels
            (gk = min(int4_group, B), gv = min(int4_group, D): KIVI's grouping)
    (H = kv_heads, B = block_tokens, D = head_dim)

Heads come before tokens so one head's tile of a block is contiguous: the decode
kernel reads [block_tokens, head_dim] per (block, head) in one sweep.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Protocol

import torch


class KVGeometry(Protocol):
    """What a layout needs of a model's geometry (kvstore.ModelSpec is one); tiers never import kvstore."""

    num_kv_heads: int
    head_dim: int


QUANT_FORMATS = ("int8", "fp8", "int4")
FORMAT_CODES = {"float16": 0, "int8": 1, "fp8": 2, "int4": 3}  # what stored values name their format by


@dataclass(slots=True)
class QuantBlocks:
    """A batch of KIVI-style quantized blocks in one of QUANT_FORMATS (module docstring: shapes)."""

    data: torch.Tensor  # int8 or uint8 [n, 2, H, B, D] (int8, fp8) | uint8 [n, 2, H, B, D // 2] (int4)
    k_scale: torch.Tensor  # f32 [n, H, D] | f16 [n, 2, H, B // gk, D]
    v_scale: torch.Tensor  # f32 [n, H, B] | f16 [n, 2, H, B, D // gv]

    @property
    def fmt(self) -> str:
        """The format, read off the tensors: int8 data is int8; fp8 data holds a byte per channel, int4 half."""
        if self.data.dtype == torch.int8:
            return "int8"
        return "fp8" if self.data.shape[-1] == self.k_scale.shape[-1] else "int4"

    def __len__(self) -> int:
        return self.data.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> QuantBlocks:
        return QuantBlocks(*(t.to(device, non_blocking=non_blocking) for t in self.tensors()))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.data, self.k_scale, self.v_scale

    def index(self, idx: torch.Tensor | slice) -> QuantBlocks:
        return QuantBlocks(*(t[idx] for t in self.tensors()))


Blocks = torch.Tensor | QuantBlocks  # a batch of blocks in any format


def format_of(blocks: Blocks) -> str:
    """"float16" or the QuantBlocks' format."""
    return blocks.fmt if isinstance(blocks, QuantBlocks) else "float16"


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """Shape arithmetic for blocks of one model geometry."""

    num_kv_heads: int
    block_tokens: int
    head_dim: int
    warm_format: str = "int8"  # the quantized format the warm tier keeps (one of QUANT_FORMATS)
    int4_group: int = 32  # int4's group: tokens of K, channels of V that share a (scale, zero)

    def __post_init__(self) -> None:
        if self.warm_format not in QUANT_FORMATS:
            raise ValueError(f"warm_format must be one of {QUANT_FORMATS}, got {self.warm_format!r}")
        gk, gv = self.int4_groups
        if self.warm_format == "int4" and (self.int4_group < 1 or self.block_tokens % gk or self.head_dim % gv
                                           or self.head_dim % 2):
            raise ValueError(f"int4_group {self.int4_group} must divide block_tokens ({self.block_tokens}) or exceed "
                             f"it, and an even head_dim ({self.head_dim}) likewise")

    @staticmethod
    def of(spec: KVGeometry, block_tokens: int, warm_format: str = "int8", int4_group: int = 32) -> BlockLayout:
        return BlockLayout(spec.num_kv_heads, block_tokens, spec.head_dim, warm_format, int4_group)

    @property
    def int4_groups(self) -> tuple[int, int]:
        """(tokens per K group, channels per V group) of int4 blocks."""
        return min(self.int4_group, self.block_tokens), min(self.int4_group, self.head_dim)

    def field_specs(self, fmt: str) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape of one block, dtype) of each tensor of a batch in `fmt`: fp16 one, quantized three."""
        h, b, d = self.num_kv_heads, self.block_tokens, self.head_dim
        if fmt == "float16":
            return [((2, h, b, d), torch.float16)]
        if fmt in ("int8", "fp8"):
            data = torch.int8 if fmt == "int8" else torch.uint8
            return [((2, h, b, d), data), ((h, d), torch.float32), ((h, b), torch.float32)]
        if fmt == "int4":
            gk, gv = self.int4_groups
            return [((2, h, b, d // 2), torch.uint8), ((2, h, b // gk, d), torch.float16),
                    ((2, h, b, d // gv), torch.float16)]
        raise ValueError(f"block format must be 'float16' or one of {QUANT_FORMATS}, got {fmt!r}")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (2, self.num_kv_heads, self.block_tokens, self.head_dim)

    @property
    def fp16_bytes(self) -> int:
        return 2 * self.num_kv_heads * self.block_tokens * self.head_dim * 2

    @property
    def int8_bytes(self) -> int:
        return self.bytes_for("int8")

    @property
    def warm_bytes(self) -> int:
        """Bytes of one block in the warm tier's format."""
        return self.bytes_for(self.warm_format)

    def bytes_for(self, fmt: str) -> int:
        """Bytes of one block in `fmt` ("float16" or one of QUANT_FORMATS), data and scales."""
        return _block_bytes(self, fmt)

    def empty_fp16(self, n: int, device: torch.device | str, pin: bool = False) -> torch.Tensor:
        return torch.empty((n, *self.shape), dtype=torch.float16, device=device, pin_memory=pin)

    def empty(self, fmt: str, n: int, device: torch.device | str, pin: bool = False) -> Blocks:
        """An uninitialised batch of n blocks in `fmt` ("float16" or one of QUANT_FORMATS)."""
        parts = [torch.empty((n, *shape), dtype=dtype, device=device, pin_memory=pin)
                 for shape, dtype in self.field_specs(fmt)]
        return parts[0] if fmt == "float16" else QuantBlocks(*parts)

    def check(self, blocks: Blocks, what: str = "blocks") -> None:
        """Raise ValueError unless `blocks` is a batch of this layout."""
        if isinstance(blocks, QuantBlocks):
            n = len(blocks)
            for name, tensor, (shape, dtype) in zip(("data", "k_scale", "v_scale"), blocks.tensors(),
                                                    self.field_specs(blocks.fmt)):
                if tuple(tensor.shape) != (n, *shape) or tensor.dtype != dtype:
                    raise ValueError(f"{what}.{name} ({blocks.fmt}): expected {dtype} {[n, *shape]}, "
                                     f"got {tensor.dtype} {list(tensor.shape)}")
            return
        if not isinstance(blocks, torch.Tensor):
            raise ValueError(f"{what}: expected a tensor or QuantBlocks, got {type(blocks).__name__}")
        if blocks.dim() != 5 or tuple(blocks.shape[1:]) != self.shape or blocks.dtype != torch.float16:
            raise ValueError(
                f"{what}: expected float16 [n, {', '.join(map(str, self.shape))}], "
                f"got {blocks.dtype} {list(blocks.shape)}"
            )


def num_blocks(blocks: Blocks) -> int:
    return len(blocks) if isinstance(blocks, QuantBlocks) else blocks.shape[0]


def concat(parts: list[Blocks]) -> Blocks:
    """CPU batches of one format -> one batch, copied with numpy: torch's CPU copies run
    intra-op thread pools that stall badly when other processes hold the cores."""
    if len({format_of(p) for p in parts}) > 1:
        raise ValueError(f"blocks of formats {sorted({format_of(p) for p in parts})} cannot share a batch")
    fields = [p.tensors() if isinstance(p, QuantBlocks) else (p,) for p in parts]
    n = sum(f[0].shape[0] for f in fields)
    outs = [torch.empty((n, *t.shape[1:]), dtype=t.dtype) for t in fields[0]]
    row = 0
    for part in fields:
        size = part[0].shape[0]
        for out, t in zip(outs, part):
            out.numpy()[row:row + size] = t.numpy()
        row += size
    return QuantBlocks(*outs) if isinstance(parts[0], QuantBlocks) else outs[0]


@functools.cache
def _block_bytes(layout: BlockLayout, fmt: str) -> int:
    """BlockLayout.bytes_for, computed once per layout and format (a load checks every value's length against it)."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout.field_specs(fmt))
