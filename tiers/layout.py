"""What a block looks like in memory, in every tier.

A block is `block_tokens` consecutive tokens of one sequence in one layer, K and V of
all kv heads. Tiers move blocks in batches:

    fp16 batch : torch.float16 [n, 2, kv_heads, block_tokens, head_dim]   (index 0 = K, 1 = V)
    int8 batch : Int8Blocks(data     int8    [n, 2, kv_heads, block_tokens, head_dim],
                            k_scale  float32 [n, kv_heads, head_dim]      K per channel (KIVI),
                            v_scale  float32 [n, kv_heads, block_tokens]) V per token  (KIVI)

Heads come before tokens so one head's tile of a block is contiguous: the decode
kernel reads [block_tokens, head_dim] per (block, head) in one sweep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class KVGeometry(Protocol):
    """What a layout needs of a model's geometry (kvstore.ModelSpec is one); tiers never import kvstore."""

    num_kv_heads: int
    head_dim: int


@dataclass(slots=True)
class Int8Blocks:
    """A batch of KIVI-quantized blocks: value = data * scale (symmetric, no zero point)."""

    data: torch.Tensor  # int8 [n, 2, H, B, D]
    k_scale: torch.Tensor  # float32 [n, H, D]
    v_scale: torch.Tensor  # float32 [n, H, B]

    def __len__(self) -> int:
        return self.data.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Int8Blocks:
        return Int8Blocks(*(t.to(device, non_blocking=non_blocking) for t in self.tensors()))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.data, self.k_scale, self.v_scale

    def index(self, idx: torch.Tensor | slice) -> Int8Blocks:
        return Int8Blocks(*(t[idx] for t in self.tensors()))


Blocks = torch.Tensor | Int8Blocks  # a batch of blocks in either format


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """Shape arithmetic for blocks of one model geometry."""

    num_kv_heads: int
    block_tokens: int
    head_dim: int

    @staticmethod
    def of(spec: KVGeometry, block_tokens: int) -> BlockLayout:
        return BlockLayout(spec.num_kv_heads, block_tokens, spec.head_dim)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (2, self.num_kv_heads, self.block_tokens, self.head_dim)

    @property
    def fp16_bytes(self) -> int:
        return 2 * self.num_kv_heads * self.block_tokens * self.head_dim * 2

    @property
    def int8_bytes(self) -> int:
        data = 2 * self.num_kv_heads * self.block_tokens * self.head_dim
        scales = 4 * self.num_kv_heads * (self.head_dim + self.block_tokens)
        return data + scales

    def bytes_for(self, dtype: str) -> int:
        return self.fp16_bytes if dtype == "float16" else self.int8_bytes

    def empty_fp16(self, n: int, device: torch.device | str, pin: bool = False) -> torch.Tensor:
        return torch.empty((n, *self.shape), dtype=torch.float16, device=device, pin_memory=pin)

    def empty_int8(self, n: int, device: torch.device | str, pin: bool = False) -> Int8Blocks:
        h, b, d = self.num_kv_heads, self.block_tokens, self.head_dim
        return Int8Blocks(
            torch.empty((n, 2, h, b, d), dtype=torch.int8, device=device, pin_memory=pin),
            torch.empty((n, h, d), dtype=torch.float32, device=device, pin_memory=pin),
            torch.empty((n, h, b), dtype=torch.float32, device=device, pin_memory=pin),
        )

    def check(self, blocks: Blocks, what: str = "blocks") -> None:
        """Raise ValueError unless `blocks` is a batch of this layout."""
        if isinstance(blocks, Int8Blocks):
            n = len(blocks)
            h, b, d = self.num_kv_heads, self.block_tokens, self.head_dim
            expected = [((n, 2, h, b, d), torch.int8), ((n, h, d), torch.float32), ((n, h, b), torch.float32)]
            for name, tensor, (shape, dtype) in zip(("data", "k_scale", "v_scale"), blocks.tensors(), expected):
                if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                    raise ValueError(
                        f"{what}.{name}: expected {dtype} {list(shape)}, got {tensor.dtype} {list(tensor.shape)}"
                    )
            return
        if not isinstance(blocks, torch.Tensor):
            raise ValueError(f"{what}: expected a tensor or Int8Blocks, got {type(blocks).__name__}")
        if blocks.dim() != 5 or tuple(blocks.shape[1:]) != self.shape or blocks.dtype != torch.float16:
            raise ValueError(
                f"{what}: expected float16 [n, {', '.join(map(str, self.shape))}], "
                f"got {blocks.dtype} {list(blocks.shape)}"
            )


def num_blocks(blocks: Blocks) -> int:
    return len(blocks) if isinstance(blocks, Int8Blocks) else blocks.shape[0]


def concat(parts: list[Blocks]) -> Blocks:
    """CPU batches of one format -> one batch, copied with numpy: torch's CPU copies run
    intra-op thread pools that stall badly when other processes hold the cores."""
    if len({isinstance(p, Int8Blocks) for p in parts}) > 1:
        raise ValueError("fp16 and int8 blocks cannot share a batch")
    fields = [p.tensors() if isinstance(p, Int8Blocks) else (p,) for p in parts]
    n = sum(f[0].shape[0] for f in fields)
    outs = [torch.empty((n, *t.shape[1:]), dtype=t.dtype) for t in fields[0]]
    row = 0
    for part in fields:
        size = part[0].shape[0]
        for out, t in zip(outs, part):
            out.numpy()[row:row + size] = t.numpy()
        row += size
    return Int8Blocks(*outs) if isinstance(parts[0], Int8Blocks) else outs[0]
