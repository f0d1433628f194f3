"""Warm tier: a preallocated int8 pool on the store's device (KIVI scales beside it)."""

from __future__ import annotations

from typing import Sequence

import torch

from tiers.base import PooledTier, SlotPool, check_ids, device_ints
from tiers.layout import BlockLayout, Blocks, Int8Blocks
from tiers.quant import quantize


class WarmTier(PooledTier):
    name = "warm"

    def __init__(self, layout: BlockLayout, capacity_bytes: int, device: torch.device | str,
                 staging_blocks: int = 0) -> None:
        self.layout = layout
        self.block_bytes = layout.int8_bytes
        self.device = torch.device(device)
        num_slots = capacity_bytes // self.block_bytes
        # Rows past num_slots are staging: int8 cold blocks fetched for one decode step, read in-kernel as int8
        # (as the hot tier stages fp16 ones), so a block attends the same whichever tier it was fetched from.
        self.pool = layout.empty_int8(num_slots + staging_blocks, self.device)
        self.slots = SlotPool(self.name, num_slots)
        self.staging_blocks = staging_blocks

    def put(self, ids: Sequence[int], blocks: Blocks) -> None:
        self.layout.check(blocks)
        check_ids(ids, len(blocks), self.name)
        if not isinstance(blocks, Int8Blocks):
            blocks = quantize(blocks.to(self.device))
        slots = device_ints(self.slots.allocate(ids), self.device)
        for dst, src in zip(self.pool.tensors(), blocks.tensors()):
            dst[slots] = src.to(self.device, non_blocking=True)

    def stage(self, blocks: Int8Blocks) -> torch.Tensor:
        """Copy int8 blocks into the staging rows; returns their slots (int32)."""
        n = len(blocks)
        if n > self.staging_blocks:
            raise ValueError(f"warm tier: {n} blocks to stage, {self.staging_blocks} staging slots")
        first = self.slots.num_slots
        for dst, src in zip(self.pool.tensors(), blocks.tensors()):
            dst[first:first + n] = src
        return torch.arange(first, first + n, dtype=torch.int32, device=self.device)

    def get(self, ids: Sequence[int]) -> Int8Blocks:
        return self.pool.index(self.slot_tensor(ids))

    def close(self) -> None:
        self.pool = self.pool.index(slice(0, 0))
