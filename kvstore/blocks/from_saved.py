"""Blocks read out of the saved tier, kept: once a value of an opened context has been read and verified, it goes
into the tier its position belongs in instead of being read from the save again.

Two readers hand blocks here: the background load (kvstore/contexts/background_load.py), batch after batch, and the
eager decode path (kvstore/decode/eager.py), which reads the blocks a token selected from the save and keeps them,
once it reads a block the second time (KEEP_AFTER), so later tokens, whose selections mostly overlap, read only
what is new and the sequence reaches the captured step (every block on the GPU or in the cpu tier) sooner.
Both put blocks as they were read, in their stored format, into free room only: no block cools to make room,
and a block that does not fit stays saved (read again when selected; store.load moves it once there is room).
A block that left the save meanwhile is skipped.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvstore.blocks.table import LayerTable
from kvstore.blocks.tierset import CPU_TIER, SAVED_TIER, TierSet
from tiers.errors import CapacityError
from tiers.layout import Blocks, QuantBlocks

# Reads of a saved block before the eager path keeps it. Keeping costs a copy into the tier; a block read once may
# never be selected again: kept at its first read, the first token of a 128K context opened on an H100 took 4.6 s
# against 2.9 (BENCHMARKS.md, Opening with a background load).
KEEP_AFTER = 2


def keep_read(tiers: TierSet, table: LayerTable, indices: Sequence[int], ids: Sequence[int], blocks: Blocks) -> int:
    """Blocks `blocks` (one format, any device), read from the saved tier for entries `indices` (block `ids`) of
    `table`: those still saved go into the tier of their position now (hot or warm window, else cpu) as far as it
    has free room; where a window's GPU tier has none, into the cpu tier, as cooling would. Returns how many moved."""
    tier_of, num_tokens = tiers.blocks.tier_of, table.num_tokens
    wanted: dict[int, list[int]] = {}  # tier -> rows of `blocks`
    for row, (index, block_id) in enumerate(zip(indices, ids)):
        if tier_of.get(block_id) == SAVED_TIER:
            wanted.setdefault(tiers.first_tier(index, num_tokens), []).append(row)
    moved = 0
    for dst, rows in sorted(wanted.items()):
        for tier in dict.fromkeys((dst, CPU_TIER)):
            fit = rows[:tiers.stack[tier].free_blocks()]
            if not fit:
                continue
            try:
                tiers.put_moved([ids[r] for r in fit], take_rows(blocks, fit), SAVED_TIER, tier, coldest=tier)
            except CapacityError:  # the tier's own budget (bytes, host memory) refused: they stay saved
                continue
            moved, rows = moved + len(fit), rows[len(fit):]
    return moved


def take_rows(blocks: Blocks, rows: list[int]) -> Blocks:
    """`blocks` at `rows` (the batch itself when it is all of them)."""
    if len(rows) == len(blocks):
        return blocks
    index = torch.tensor(rows, dtype=torch.long, device=blocks.data.device if isinstance(blocks, QuantBlocks)
                         else blocks.device)
    return blocks.index(index) if isinstance(blocks, QuantBlocks) else blocks[index]
