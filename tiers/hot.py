"""Hot tier: a preallocated fp16 pool on the store's device, one slot per block."""

from __future__ import annotations

from typing import Sequence

import torch

from tiers.base import DevicePoolTier
from tiers.layout import BlockLayout, Blocks, QuantBlocks
from tiers.quant import dequantize


class HotTier(DevicePoolTier):
    name = "hot"

    def __init__(self, layout: BlockLayout, capacity_bytes: int, device: torch.device | str,
                 staging_blocks: int = 0) -> None:
        super().__init__(layout, layout.fp16_bytes, capacity_bytes, device, staging_blocks)
        # a row past the staging rows that no block holds: a batch's empty rows append their tokens there
        # (kvstore/decode/batch_slots.py), so a captured batch step never writes into a stored block for them
        self.scratch_slot = self.slots.num_slots + staging_blocks
        self.pool = layout.empty_fp16(self.scratch_slot + 1, self.device)  # [S + staging + 1, 2, H, B, D]

    def _to_format(self, blocks: Blocks) -> torch.Tensor:
        return dequantize(blocks.to(self.device)) if isinstance(blocks, QuantBlocks) else blocks

    def _write_rows(self, rows: torch.Tensor | slice, blocks: torch.Tensor) -> None:
        self.pool[rows] = blocks

    def write_tokens(self, block_id: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [t, H, D] at token offset `start` of a stored block (appends to a tail block).
        One copy for K and V together: a decode step's append is launch-bound on a GPU."""
        slot = self.slots.lookup([block_id])[0]
        self.pool[slot, :, :, start:start + k.shape[0]] = torch.stack([k, v]).transpose(1, 2)  # [2, H, t, D]

    def get(self, ids: Sequence[int]) -> torch.Tensor:
        return self.pool[self.slot_tensor(ids)]

    def close(self) -> None:
        self.pool = self.pool[:0]
