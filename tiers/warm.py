"""Warm tier: a preallocated int8 pool on the store's device (KIVI scales beside it)."""

from __future__ import annotations

from typing import Sequence

import torch

from tiers.base import PooledTier, SlotPool, check_ids, device_ints
from tiers.layout import BlockLayout, Blocks, Int8Blocks
from tiers.quant import quantize


class WarmTier(PooledTier):
    name = "warm"

    def __init__(self, layout: BlockLayout, capacity_bytes: int, device: torch.device | str) -> None:
        self.layout = layout
        self.block_bytes = layout.int8_bytes
        self.device = torch.device(device)
        self.pool = layout.empty_int8(capacity_bytes // self.block_bytes, self.device)
        self.slots = SlotPool(self.name, len(self.pool))

    def put(self, ids: Sequence[int], blocks: Blocks) -> None:
        self.layout.check(blocks)
        check_ids(ids, len(blocks), self.name)
        if not isinstance(blocks, Int8Blocks):
            blocks = quantize(blocks.to(self.device))
        slots = device_ints(self.slots.allocate(ids), self.device)
        for dst, src in zip(self.pool.tensors(), blocks.tensors()):
            dst[slots] = src.to(self.device, non_blocking=True)

    def get(self, ids: Sequence[int]) -> Int8Blocks:
        return self.pool.index(self.slot_tensor(ids))

    def close(self) -> None:
        self.pool = self.pool.index(slice(0, 0))
