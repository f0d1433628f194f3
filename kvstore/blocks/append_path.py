"""AppendPath, the eager write path: K/V of one layer into its block table.

fill the tail block in place -> lay out the new blocks [n, 2, H, B, D] -> place each where its
position belongs (hot window, warm window, cold) -> cool the blocks the append pushed out of
their windows. All or nothing up to the placement: when the tiers refuse the new blocks, the
tail's tokens are taken back and nothing else changed. The captured step (kvstore/decode/step.py)
appends one token on the device instead and opens tail blocks itself.
"""

from __future__ import annotations

import torch

from kvstore.blocks.table import LayerTable, TableTensors
from kvstore.blocks.tierset import TierSet
from kvstore.config import Config


class AppendPath:
    def __init__(self, config: Config, tiers: TierSet, tensors: TableTensors) -> None:
        self.block_tokens = config.block_tokens
        self.num_kv_heads, self.head_dim = config.model.num_kv_heads, config.model.head_dim
        self.tiers, self.tensors, self.device = tiers, tensors, tiers.device

    def append(self, seq: int, layer: int, table: LayerTable, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, H, D] (checked by the caller) after the tokens of `table`, registered as (seq, layer).
        CapacityError, with the table unchanged, when the tiers cannot hold the new blocks."""
        b = self.block_tokens
        fill = (-table.num_tokens) % b if table.block_ids else 0  # room left in the tail block
        head = min(fill, k.shape[0])
        num_new = -(-(k.shape[0] - head) // b)
        old_tokens = table.num_tokens
        if num_new:
            self.tiers.check_room(num_new)
        if head:  # fill the tail block in place; undone below if the new blocks are refused
            tail = table.num_blocks - 1
            tail_summary = table.summaries[tail].clone()
            self.tiers.hot.write_tokens(table.block_ids[tail], b - fill, k[:head], v[:head])
            self.tensors.extend_tail(table, tail, k[:head])
            table.num_tokens += head
            if head == fill:  # the tail block is full: its sketch codes on the final grid
                keys = self.tiers.gather([table.block_ids[tail]], self.device)[0, 0].transpose(0, 1)  # [B, H, D]
                self.tensors.encode_block(table, tail, keys)
        if num_new:
            try:
                self._new_blocks(seq, layer, table, k[head:], v[head:])
            except BaseException:
                if head:  # the bytes past num_tokens are never read
                    table.num_tokens -= head
                    table.summaries[tail] = tail_summary
                raise
        self.tiers.cool(table, old_tokens)

    def _new_blocks(self, seq: int, layer: int, table: LayerTable, k: torch.Tensor, v: torch.Tensor) -> None:
        """New blocks for k, v [t, H, D] after the table's full blocks; all placed, or none and nothing changed."""
        b, t = self.block_tokens, k.shape[0]
        n, full = -(-t // b), t // b
        blocks = torch.zeros((n, 2, self.num_kv_heads, b, self.head_dim),
                             dtype=torch.float16, device=self.device)  # [n, 2, H, B, D]
        kv = torch.stack([k, v])  # [2, T, H, D]
        blocks[:full] = kv[:, :full * b].reshape(2, full, b, *k.shape[1:]).permute(1, 0, 3, 2, 4)
        if full < n:
            blocks[-1, :, :, : t - full * b] = kv[:, full * b:].transpose(1, 2)
        first = table.num_blocks
        ids = self.tiers.blocks.new_ids(n, seq, layer, first)
        self.tensors.write_new(table, first, k)
        table.block_ids.extend(ids)
        table.num_tokens += t
        tiers = [self.tiers.first_tier(first + i, table.num_tokens) for i in range(n)]
        placed: list[int] = []
        try:
            for tier in sorted(set(tiers)):
                group = [i for i, lv in enumerate(tiers) if lv == tier]
                self.tiers.place([ids[i] for i in group], blocks[group], tier)
                placed += [ids[i] for i in group]
        except BaseException:
            self.tiers.delete(placed)
            self.tiers.blocks.forget_owners([i for i in ids if i not in set(placed)])
            del table.block_ids[first:]
            table.num_tokens -= t
            raise
