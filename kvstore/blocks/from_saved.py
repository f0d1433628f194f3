"""Blocks out of the saved tier: an opened context's values, once read and verified, go into the tier their
position belongs in instead of being read from the save again.

`load_saved` (store.load) reads them itself, batch after batch. Two readers hand what they read to `keep_read`:
the background load (kvstore/contexts/background_load.py), batch after batch, and the eager decode path
(kvstore/decode/eager.py), which reads the blocks a token selected from the save and keeps a block once it reads
it the second time (KEEP_AFTER), so later tokens, whose selections mostly overlap, read only what is new and the
sequence reaches the captured step (every block on the GPU or in the cpu tier) sooner.
All of them put blocks as they were read, in their stored format (a quantized one into the warm tier, not the hot
one: TierSet.home_tier), into free room only: no block cools to make room, and a block that does not fit stays
saved (read again when selected; store.load moves it once there is room). A block that left the save meanwhile
is skipped.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvstore.blocks.table import LayerTable
from kvstore.blocks.tierset import CPU_TIER, SAVED_TIER, TierSet
from tiers.errors import CapacityError
from tiers.layout import Blocks, QuantBlocks
from tiers.stored import StoredBlocks

LOAD_BATCH = 2048  # blocks a load_saved move reads at once (128 MiB of llama3-8b int8 blocks at 32 tokens)
# Reads of a saved block before the eager path keeps it. Keeping costs a copy into the tier; a block read once may
# never be selected again: kept at its first read, the first token of a 128K context opened on an H100 took 4.6 s
# against 2.9 (BENCHMARKS.md, Opening with a background load).
KEEP_AFTER = 2


def keep_read(tiers: TierSet, table: LayerTable, indices: Sequence[int], ids: Sequence[int],
              blocks: Blocks | StoredBlocks) -> int:
    """Blocks `blocks` (any device; StoredBlocks: each format on its own), read from the saved tier for entries
    `indices` (block `ids`) of `table`: those still saved go into the tier of their position now (hot or warm
    window, else cpu; a block in the warm format no higher than warm: TierSet.home_tier) as far as it has free
    room; where a window's GPU tier has none, into the cpu tier, as cooling would. Returns how many moved."""
    if isinstance(blocks, StoredBlocks):
        return sum(keep_read(tiers, table, [indices[a] for a in at], [ids[a] for a in at], part)
                   for at, part in blocks.parts())
    tier_of, num_tokens = tiers.blocks.tier_of, table.num_tokens
    wanted: dict[int, list[int]] = {}  # tier -> rows of `blocks`
    for row, (index, block_id) in enumerate(zip(indices, ids)):
        if tier_of.get(block_id) == SAVED_TIER:
            wanted.setdefault(tiers.home_tier(blocks, tiers.first_tier(index, num_tokens)), []).append(row)
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


def load_saved(tiers: TierSet, tables: Sequence[LayerTable], max_blocks: int | None) -> int:
    """Move up to `max_blocks` (None: all) of the blocks an opened context left in the saved tier, table after
    table, into the tier their position belongs in (hot or warm window, else cpu), newest first and into free
    room only: no block cools to make room, and what does not fit stays saved (still read when selected).
    Returns how many moved. A damaged or missing saved block raises (IntegrityError, BlockMissingError) and its
    batch stays where it was."""
    moved, left = 0, float("inf") if max_blocks is None else max_blocks
    for table in tables:
        if moved >= left:
            break
        moved += _load_table(tiers, table, int(min(left - moved, table.num_blocks)))
    return moved


def _load_table(tiers: TierSet, table: LayerTable, limit: int) -> int:
    n = table.num_blocks
    if limit <= 0 or not n:
        return 0
    saved = torch.nonzero(table.tier_map[:n] == SAVED_TIER).flatten().tolist()  # one sync
    wanted: dict[int, list[int]] = {}
    for index in reversed(saved[-limit:]):
        wanted.setdefault(tiers.first_tier(index, table.num_tokens), []).append(table.block_ids[index])
    moved = 0
    for dst, ids in sorted(wanted.items()):
        group = ids[:min(limit - moved, tiers.stack[dst].free_blocks())]
        for lo in range(0, len(group), LOAD_BATCH):  # bounded (pinned) buffers, reused batch after batch
            batch = group[lo: lo + LOAD_BATCH]
            tiers.saved.read_ahead(group[lo + LOAD_BATCH: lo + 2 * LOAD_BATCH])  # read while this one moves
            try:
                tiers.move(batch, SAVED_TIER, dst, coldest=dst)
            except CapacityError:  # the tier's own budget (bytes, host memory) refused: they stay saved
                break
            moved += len(batch)
    return moved


def take_rows(blocks: Blocks, rows: list[int]) -> Blocks:
    """`blocks` at `rows` (the batch itself when it is all of them)."""
    if len(rows) == len(blocks):
        return blocks
    index = torch.tensor(rows, dtype=torch.long, device=blocks.data.device if isinstance(blocks, QuantBlocks)
                         else blocks.device)
    return blocks.index(index) if isinstance(blocks, QuantBlocks) else blocks[index]
