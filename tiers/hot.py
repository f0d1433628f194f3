"""Hot tier: a preallocated fp16 pool on the store's device, one slot per block."""

from __future__ import annotations

from typing import Sequence

import torch

from tiers.base import PooledTier, SlotPool, check_ids, device_ints
from tiers.layout import BlockLayout, Blocks, Int8Blocks
from tiers.quant import dequantize


class HotTier(PooledTier):
    name = "hot"

    def __init__(self, layout: BlockLayout, capacity_bytes: int, device: torch.device | str,
                 staging_blocks: int = 0) -> None:
        self.layout = layout
        self.block_bytes = layout.fp16_bytes
        self.device = torch.device(device)
        num_slots = capacity_bytes // self.block_bytes
        # Rows past num_slots are staging: cold blocks fetched for one decode step, not stored here.
        self.pool = layout.empty_fp16(num_slots + staging_blocks, self.device)  # [S + staging, 2, H, B, D]
        self.slots = SlotPool(self.name, num_slots)
        self.staging_blocks = staging_blocks

    def put(self, ids: Sequence[int], blocks: Blocks) -> None:
        self.layout.check(blocks)
        check_ids(ids, len(blocks), self.name)
        if isinstance(blocks, Int8Blocks):
            blocks = dequantize(blocks.to(self.device))
        slots = self.slots.allocate(ids)
        self.pool[device_ints(slots, self.device)] = blocks.to(self.device, non_blocking=True)

    def write_tokens(self, block_id: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [t, H, D] at token offset `start` of a stored block (appends to a tail block).
        One copy for K and V together: a decode step's append is launch-bound on a GPU."""
        slot = self.slots.lookup([block_id])[0]
        self.pool[slot, :, :, start:start + k.shape[0]] = torch.stack([k, v]).transpose(1, 2)  # [2, H, t, D]

    def stage(self, blocks: torch.Tensor) -> torch.Tensor:
        """Copy fp16 blocks [n, 2, H, B, D] into the staging rows; returns their slots (int32)."""
        n = blocks.shape[0]
        if n > self.staging_blocks:
            raise ValueError(f"hot tier: {n} blocks to stage, {self.staging_blocks} staging slots")
        first = self.slots.num_slots
        self.pool[first:first + n] = blocks
        return torch.arange(first, first + n, dtype=torch.int32, device=self.device)

    def get(self, ids: Sequence[int]) -> torch.Tensor:
        return self.pool[self.slot_tensor(ids)]

    def close(self) -> None:
        self.pool = self.pool[:0]
