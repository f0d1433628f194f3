"""Warm tier: a preallocated int8 pool on the store's device (KIVI scales beside it)."""

from __future__ import annotations

from typing import Sequence

import torch

from tiers.base import DevicePoolTier
from tiers.layout import BlockLayout, Blocks, Int8Blocks
from tiers.quant import quantize


class WarmTier(DevicePoolTier):
    name = "warm"

    def __init__(self, layout: BlockLayout, capacity_bytes: int, device: torch.device | str,
                 staging_blocks: int = 0) -> None:
        super().__init__(layout, layout.int8_bytes, capacity_bytes, device, staging_blocks)
        # int8 staging rows: cold int8 blocks are read in-kernel as int8 (as the hot tier stages fp16 ones), so a
        # block attends the same whichever tier it was fetched from
        self.pool = layout.empty_int8(self.slots.num_slots + staging_blocks, self.device)

    def _to_format(self, blocks: Blocks) -> Int8Blocks:
        return blocks if isinstance(blocks, Int8Blocks) else quantize(blocks.to(self.device))

    def _write_rows(self, rows: torch.Tensor | slice, blocks: Int8Blocks) -> None:
        for dst, src in zip(self.pool.tensors(), blocks.tensors()):
            dst[rows] = src

    def get(self, ids: Sequence[int]) -> Int8Blocks:
        return self.pool.index(self.slot_tensor(ids))

    def close(self) -> None:
        self.pool = self.pool.index(slice(0, 0))
