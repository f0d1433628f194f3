"""Per (sequence, layer) block tables and the device tensors the decode path reads.

For every block of a table the store keeps, on its device:
  summaries  fp16 [n, 2, H, D]  elementwise min (0) and max (1) of the block's keys
  sketch     uint8 [n, H, 2, B, D/4]  4-bit codes of every key on the summary's grid (eviction/sketch.py);
                                 a block's codes are written when it is created and again when it fills
                                 (a partial tail block is always attended, so its codes may lag)
  slot_map   int32 [n]          slot in the hot or warm pool or the cpu tier (-1 beyond it or dropped)
  tier_map   int8 [n]           tier index: 0 hot, 1 warm, 2 cpu, 3 cold (ssd/remote/redis), -1 dropped
so one decode step turns a selection into a kernel block table without a host round trip.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eviction.sketch import encode_blocks
from eviction.summaries import summarize_keys
from kvstore.blocks.map_scatter import scatter_locations
from tiers.base import device_ints

DROPPED = -1  # block id of a block H2O drop-mode evicted for good


@dataclass(slots=True)
class LayerTable:
    """The blocks of one sequence in one layer, oldest first."""

    block_ids: list[int] = field(default_factory=list)  # block index -> global block id (or DROPPED)
    num_tokens: int = 0
    summaries: torch.Tensor | None = None  # fp16 [capacity, 2, H, D]
    sketch: torch.Tensor | None = None  # uint8 [capacity, H, 2, B, D // 4]
    slot_map: torch.Tensor | None = None  # int32 [capacity]
    tier_map: torch.Tensor | None = None  # int8 [capacity]
    num_warm: int = 0  # blocks in the warm tier
    num_cold: int = 0  # blocks in the cpu or ssd tier (the decode path stages them)
    num_far: int = 0  # of those, blocks beyond the cpu tier (ssd, remote, saved): no captured step reaches them
    num_dropped: int = 0  # blocks H2O drop mode freed
    h2o_scores: torch.Tensor | None = None  # fp32 [H, capacity]: accumulated attention mass
    cold_hits: dict[int, int] = field(default_factory=dict)  # block index -> times fetched while cold
    moves: int = 0  # times the device maps were written or reallocated (a kept partition of them is stale)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def live_indices(self) -> list[int]:
        """Indices of the blocks H2O drop mode has not freed, ascending."""
        if not self.num_dropped:
            return list(range(self.num_blocks))
        return [i for i, b in enumerate(self.block_ids) if b != DROPPED]


def droppable(table: LayerTable, indices: object) -> list[int]:
    """`indices` as a list of distinct entries of `table` that H2O drop mode may free (held, not the tail block),
    else ValueError saying what was wrong."""
    indices = list(indices) if isinstance(indices, (list, tuple, range)) else indices
    n = table.num_blocks
    if not isinstance(indices, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
        raise ValueError(f"drop: indices must be a list of ints, got {indices!r}")
    bad = [i for i in indices if not 0 <= i < n - 1]
    if bad:
        raise ValueError(f"drop: block indices must be in [0, {n - 1}) (the tail block {n - 1} stays), got {bad[:8]}")
    if len(set(indices)) != len(indices):
        raise ValueError(f"drop: duplicate block indices in {indices[:16]}")
    if any(table.block_ids[i] == DROPPED for i in indices):
        raise ValueError("drop: a block was already dropped")
    return indices


class TableTensors:
    """Grows and writes the device tensors of LayerTables (capacity doubles; a new table has 1/16 to spare)."""

    def __init__(self, num_kv_heads: int, head_dim: int, block_tokens: int, device: torch.device,
                 sketch_codes: bool = True) -> None:
        self.sketch_codes = sketch_codes  # False: sketch tensors of width 0, nothing encoded (Config.sketch_codes)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_tokens = block_tokens
        self.device = device
        self.reallocations = 0  # tables given new tensors so far (a batch holding their addresses checks it)

    def bytes_per_block(self) -> int:
        """Device bytes of one block's entry in a table: summaries, slot and tier maps, H2O scores, sketch codes."""
        h, d, b = self.num_kv_heads, self.head_dim, self.block_tokens
        return 2 * h * d * 2 + 4 + 1 + 4 * h + h * 2 * b * self.code_bytes

    @property
    def code_bytes(self) -> int:
        """Bytes of one token's sketch code per kv head and K or V row (0 without sketch codes)."""
        return self.head_dim // 4 if self.sketch_codes else 0

    def reserve(self, table: LayerTable, num_blocks: int, exact: bool = False) -> None:
        """Room for num_blocks entries. Growing appends double the room (amortized copies); exact (a decode
        step's fixed capacity) allocates just num_blocks: at long contexts the sketch codes alone are an eighth
        of the fp16 K/V, so a doubled table wastes GiBs."""
        capacity = 0 if table.summaries is None else table.summaries.shape[0]
        if num_blocks <= capacity:
            return
        # a table made at its full length (open, fork) gets room to grow, so its first new block does not
        # reallocate and copy every tensor of a long context
        new = max(num_blocks, 2 * capacity) if capacity else num_blocks + max(16, num_blocks // 16)
        if exact:
            new = num_blocks
        h, d, dev = self.num_kv_heads, self.head_dim, self.device
        grown = (
            torch.empty((new, 2, h, d), dtype=torch.float16, device=dev),
            torch.full((new,), -1, dtype=torch.int32, device=dev),
            torch.full((new,), DROPPED, dtype=torch.int8, device=dev),
            torch.zeros((h, new), dtype=torch.float32, device=dev),
            torch.zeros((new, h, 2, self.block_tokens, self.code_bytes), dtype=torch.uint8, device=dev),
        )
        if capacity:
            grown[0][:capacity] = table.summaries
            grown[1][:capacity] = table.slot_map
            grown[2][:capacity] = table.tier_map
            grown[3][:, :capacity] = table.h2o_scores
            grown[4][:capacity] = table.sketch
        table.summaries, table.slot_map, table.tier_map, table.h2o_scores, table.sketch = grown
        table.moves += 1
        self.reallocations += 1

    def extend_tail(self, table: LayerTable, index: int, k: torch.Tensor) -> None:
        """Fold keys k [t, H, D] appended to block `index` into its summary."""
        s = table.summaries[index]  # [2, H, D]
        low, high = (k[0], k[0]) if k.shape[0] == 1 else (k.amin(dim=0), k.amax(dim=0))  # decode: no reduction
        torch.minimum(s[0], low, out=s[0])
        torch.maximum(s[1], high, out=s[1])

    def write_new(self, table: LayerTable, first: int, k: torch.Tensor) -> None:
        """Summaries and sketch codes of new blocks first, first+1, ... holding keys k [t, H, D] (last may be
        partial)."""
        summaries = summarize_keys(k, self.block_tokens)  # [n, 2, H, D]
        n, b = summaries.shape[0], self.block_tokens
        self.reserve(table, first + n)
        table.summaries[first:first + n] = summaries
        if not self.sketch_codes:
            return
        padded = torch.cat((k, k[-1:].expand(n * b - k.shape[0], -1, -1)))  # [n*B, H, D]: repeat a real key
        table.sketch[first:first + n] = encode_blocks(padded.view(n, b, *k.shape[1:]), summaries)

    def encode_block(self, table: LayerTable, index: int, keys: torch.Tensor) -> None:
        """Sketch codes of block `index`, now full with keys [B, H, D], on its summary's final grid."""
        if self.sketch_codes:
            table.sketch[index: index + 1] = encode_blocks(keys[None], table.summaries[index: index + 1])

    def copy(self, table: LayerTable) -> LayerTable:
        """A new table pointing at the same block ids, with its own device maps, summaries, sketch, H2O scores
        and counts (a fork; the tier set then makes the copy a holder of those blocks)."""
        n = table.num_blocks
        out = LayerTable(list(table.block_ids), table.num_tokens, num_warm=table.num_warm,
                         num_cold=table.num_cold, num_far=table.num_far, num_dropped=table.num_dropped)
        if n:
            self.reserve(out, n)
            out.summaries[:n] = table.summaries[:n]
            out.sketch[:n] = table.sketch[:n]
            out.slot_map[:n] = table.slot_map[:n]
            out.tier_map[:n] = table.tier_map[:n]
            out.h2o_scores[:, :n] = table.h2o_scores[:, :n]
        return out

    def set_locations(self, moved: list[tuple[LayerTable, list[int], list[int]]], tier: int) -> None:
        """set_location for many tables at once: (table, indices, slots) each; on CUDA one copy and one launch
        for all of them (kvstore/blocks/map_scatter.py)."""
        if self.device.type != "cuda" or len(moved) == 1:
            for table, indices, slots in moved:
                self.set_location(table, indices, slots, tier)
            return
        scatter_locations([(t.slot_map, t.tier_map) for t, _, _ in moved], [i for _, i, _ in moved],
                          [s for _, _, s in moved], tier)
        for table, _, _ in moved:
            table.moves += 1

    def set_location(self, table: LayerTable, indices: list[int], slots: list[int], tier: int) -> None:
        """Blocks `indices` of `table` now live in `tier` at `slots` (-1 for tiers without slots)."""
        idx = device_ints(indices, self.device)
        table.slot_map[idx] = device_ints(slots, self.device, torch.int32)
        table.tier_map.index_fill_(0, idx, tier)  # `tier_map[idx] = tier` would copy the scalar over and sync
        table.moves += 1
