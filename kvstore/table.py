"""Per (sequence, layer) block tables and the key summaries top-K selection scans."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class LayerTable:
    """The blocks of one sequence in one layer, oldest first."""

    block_ids: list[int] = field(default_factory=list)  # block index -> global block id
    num_tokens: int = 0
    summaries: torch.Tensor | None = None  # fp16 [capacity, 2, H, D]: min (0) and max (1) of K per block


class Summaries:
    """Keeps `LayerTable.summaries` on the store's device, growing it by doubling."""

    def __init__(self, num_kv_heads: int, head_dim: int, block_tokens: int, device: torch.device) -> None:
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_tokens = block_tokens
        self.device = device

    def reserve(self, table: LayerTable, num_blocks: int) -> None:
        capacity = 0 if table.summaries is None else table.summaries.shape[0]
        if num_blocks <= capacity:
            return
        grown = torch.empty((max(num_blocks, 2 * capacity, 16), 2, self.num_kv_heads, self.head_dim),
                            dtype=torch.float16, device=self.device)
        if capacity:
            grown[:capacity] = table.summaries
        table.summaries = grown

    def extend_tail(self, table: LayerTable, index: int, k: torch.Tensor) -> None:
        """Fold keys k [t, H, D] appended to block `index` into its summary."""
        s = table.summaries[index]
        s[0] = torch.minimum(s[0], k.amin(dim=0))
        s[1] = torch.maximum(s[1], k.amax(dim=0))

    def write_new(self, table: LayerTable, first: int, k: torch.Tensor) -> None:
        """Summaries of new blocks first, first+1, ... holding keys k [t, H, D] (last may be partial)."""
        b = self.block_tokens
        n = -(-k.shape[0] // b)
        pad = n * b - k.shape[0]
        if pad:  # repeat the last key so the padding changes neither min nor max
            k = torch.cat([k, k[-1:].expand(pad, -1, -1)])
        k = k.view(n, b, self.num_kv_heads, self.head_dim)
        self.reserve(table, first + n)
        table.summaries[first:first + n, 0] = k.amin(dim=1)
        table.summaries[first:first + n, 1] = k.amax(dim=1)
