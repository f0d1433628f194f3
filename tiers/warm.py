"""Warm tier: a preallocated pool of quantized blocks on the store's device, in the layout's warm_format
(int8, fp8 or int4: tiers/quant.py), KIVI scales beside them."""

from __future__ import annotations

from typing import Sequence

import torch

from tiers.base import DevicePoolTier
from tiers.layout import BlockLayout, Blocks, QuantBlocks
from tiers.quant import to_format


class WarmTier(DevicePoolTier):
    name = "warm"

    def __init__(self, layout: BlockLayout, capacity_bytes: int, device: torch.device | str,
                 staging_blocks: int = 0) -> None:
        super().__init__(layout, layout.warm_bytes, capacity_bytes, device, staging_blocks)
        self.format = layout.warm_format
        # staging rows in the same format: cold blocks held in it are read in-kernel as they are (as the hot tier
        # stages fp16 ones), so a block attends the same whichever tier it was fetched from
        self.pool = layout.empty(self.format, self.slots.num_slots + staging_blocks, self.device)

    def _to_format(self, blocks: Blocks) -> QuantBlocks:
        return to_format(blocks.to(self.device), self.format, self.layout.int4_group)

    def _write_rows(self, rows: torch.Tensor | slice, blocks: QuantBlocks) -> None:
        for dst, src in zip(self.pool.tensors(), blocks.tensors()):
            dst[rows] = src

    def get(self, ids: Sequence[int]) -> QuantBlocks:
        return self.pool.index(self.slot_tensor(ids))

    def close(self) -> None:
        self.pool = self.pool.index(slice(0, 0))
