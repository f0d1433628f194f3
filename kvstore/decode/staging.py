"""Staging: the cold blocks a decode step selected, fetched for that step in the format they are stored in.

A block attends bit for bit the same whichever tier it is read from while it keeps its format, so a
sequence decodes the same tokens whether its blocks sit in the GPU pools, were cooled to cpu or ssd, or
were saved and opened in another process (kvstore/contexts/saving.py). Two moves change a block's format: a warm
(quantized: Config.warm_format) block cooling into an fp16 cpu tier is dequantized, and an fp16 cold block fetched
PROMOTE_AFTER times (kvstore/blocks/promotion.py) is quantized into the warm tier; with cpu_dtype = the warm format (the h200 preset's
"int8") neither happens to a value the kernel reads, otherwise a reopened sequence, whose fetch counts start at
zero, may promote at other steps than the writer would have.
  - an fp16 block (hot, or held fp16 by a cold tier) is read by the kernel's fp16 path, a block in the warm
    format (warm, or held so by cpu, ssd or a save) by its quantized path: cold blocks are staged in the format
    their tier holds, fp16 ones into the hot pool's staging rows, quantized ones into the warm pool's (a
    block saved by a store of another warm format is dequantized and staged as fp16);
  - more selected cold blocks than staging rows: the step attends over temporary pools of every
    selected block, again one pool per format;
  - the kernel always gets both pools (the warm one always has its staging rows), so which build and walk
    it runs never depends on where the step's blocks happen to be (the captured step's dense phase is the one
    exception: while no block of the sequence is warm it passes no warm pool, kvstore/decode/step.py).
The ssd and saved tiers report each block's own format (`fetch_as_stored`: verified where the values lie,
one batch per format, one host-to-device copy); the sidecar and redis tiers hand a batch mixing formats back
as fp16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvstore.blocks.table import LayerTable
from kvstore.blocks.tierset import CPU_TIER, TierSet
from tiers.base import device_ints
from tiers.layout import QuantBlocks, format_of
from tiers.quant import dequantize
from tiers.stored import MixedFormatTier, StoredBlocks


@dataclass(slots=True)
class Staged:
    """What a step attends with: the two pools and its block table (slots int32 [H, k], is_int8 bool [H, k])."""

    hot_pool: torch.Tensor
    warm: QuantBlocks
    slots: torch.Tensor
    is_int8: torch.Tensor
    fetched: list[int]  # indices (in the table) of the cold blocks fetched; [] when none were selected
    read: StoredBlocks | None = None  # what was fetched, as stored; its fp16_at / quant_at index `read_at`
    read_at: list[int] | None = None  # indices (in the table) of the blocks `read` holds


def gather_as_stored(tiers: TierSet, ids: Sequence[int], device: torch.device) -> StoredBlocks:
    """The blocks `ids` on `device`, each in the format its tier holds it in, verified: one batch per format
    (a tier's own when one tier holds all of them)."""
    fp16: list[tuple[list[int], torch.Tensor]] = []
    quant: list[tuple[list[int], QuantBlocks]] = []
    position = {block_id: i for i, block_id in enumerate(ids)}
    layout = tiers.layout
    for tier, group in tiers.blocks.by_tier(ids).items():
        source = tiers.stack[tier]
        at = [position[i] for i in group]
        if isinstance(source, MixedFormatTier):  # a tier holding blocks of several formats (ssd, saved)
            parts = source.fetch_as_stored(group, device).parts()
        else:
            parts = [(list(range(len(group))), source.fetch(group, device))]
        for rows, blocks in parts:
            if format_of(blocks) not in ("float16", layout.warm_format):  # held by a store of another format
                blocks = dequantize(blocks)
            (quant if isinstance(blocks, QuantBlocks) else fp16).append(([at[r] for r in rows], blocks))
    fp16_blocks = fp16[0][1] if len(fp16) == 1 else torch.cat([b for _, b in fp16]) if fp16 else \
        layout.empty_fp16(0, device)
    quant_blocks = quant[0][1] if len(quant) == 1 else \
        QuantBlocks(*(torch.cat(fields) for fields in zip(*(b.tensors() for _, b in quant)))) if quant else \
        layout.empty(layout.warm_format, 0, device)
    return StoredBlocks([i for at, _ in fp16 for i in at], fp16_blocks, [i for at, _ in quant for i in at],
                        quant_blocks)


def stage(tiers: TierSet, table: LayerTable, selected: torch.Tensor, slots: torch.Tensor,
          is_int8: torch.Tensor) -> Staged:
    """The pools and block table to attend `selected` [H, k] of `table` with, its cold blocks fetched (one
    host sync, only when the table has cold blocks). slots / is_int8: block_table's, for the GPU-held ones."""
    hot, warm, device = tiers.hot, tiers.warm, tiers.device
    if not table.num_cold:
        return Staged(hot.pool, warm.pool, slots, is_int8, [])
    cold = table.tier_map[selected] >= CPU_TIER  # [H, k]
    cold_indices = torch.unique(selected[cold]).tolist()
    if not cold_indices:
        return Staged(hot.pool, warm.pool, slots, is_int8, [])
    new_slot = torch.full((table.num_blocks,), -1, dtype=torch.int32, device=device)
    new_int8 = torch.zeros((table.num_blocks,), dtype=torch.bool, device=device)
    staged = len(cold_indices) <= min(hot.staging_blocks, warm.staging_blocks)
    indices = cold_indices if staged else torch.unique(selected).tolist()  # overflow: every selected block
    got = gather_as_stored(tiers, [table.block_ids[i] for i in indices], device)
    fp16_at = device_ints([indices[i] for i in got.fp16_at], device)
    quant_at = device_ints([indices[i] for i in got.quant_at], device)
    new_int8[quant_at] = True
    if staged:
        new_slot[fp16_at] = hot.stage(got.fp16)
        new_slot[quant_at] = warm.stage(got.quant)
        return Staged(hot.pool, warm.pool, torch.where(cold, new_slot[selected], slots),
                      torch.where(cold, new_int8[selected], is_int8), cold_indices, got, indices)
    new_slot[fp16_at] = torch.arange(len(got.fp16_at), dtype=torch.int32, device=device)
    new_slot[quant_at] = torch.arange(len(got.quant_at), dtype=torch.int32, device=device)
    # an empty temporary pool is replaced by the tier's (never read: no entry points at it), so the kernel's
    # build (which pools are non-empty) stays what the config makes it
    hot_pool = got.fp16 if got.fp16_at else hot.pool
    warm_pool = got.quant if got.quant_at else warm.pool
    return Staged(hot_pool, warm_pool, new_slot[selected], new_int8[selected], cold_indices, got, indices)
