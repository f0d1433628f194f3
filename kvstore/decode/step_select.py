"""StepSelect: which blocks one layer of a captured decode step reads, from device state only.

    dense   the table itself, viewed up to the step's bucket of blocks and shared by the kv heads (stride 0):
            no gather, no launch; its tier codes are the kernel's int8 flags (a dense phase holds hot and
            warm blocks only)
    topk    Quest's bound over the table's capacity from the device count (blocks past it -inf, sinks and
            the recent window +inf), then k blocks per kv head, ascending; on CUDA two launches whose second
            writes the kernel's block table (eviction/topk_kernel.py)
    sketch  the 4-bit key sketch (eviction/sketch_topk.py) over the live and protected masks of the token
            (`count`, once per token), whose final top-k writes the block table too
    cascade Quest's bound as in topk picks candidate_factor x k candidates, their 4-bit codes rank them by
            estimated softmax mass, the k best are read (eviction/cascade.py CascadeTopK.select_scored)
    window  the sinks, the recent window, then the newest other blocks (eviction/window.py): the same blocks in
            every layer and kv head, chosen once per token (`count`) from the device count
    h2o     the layer's live blocks, kept on the device by the host's drop decisions (step_h2o.py), every kv head
A batch of sequences in the topk phase selects for all of them at once instead (batch_rows.py).
"""

from __future__ import annotations

import torch

from eviction import Policy
from eviction.cascade import CascadeTopK
from eviction.quest_kernel import live_and_protected, quest_scores_live, quest_scores_live_ref
from eviction.select import top_blocks
from eviction.sketch_topk import SketchTopK
from eviction.topk_kernel import can_select, topk_block_table, two_stage
from kvstore.blocks.table import LayerTable
from kvstore.blocks.tierset import WARM_TIER
from kvstore.decode.eager import block_table


class StepSelect:
    def __init__(self, policy: Policy | None, capacity: int, k: int, block_tokens: int, sink_blocks: int,
                 recent_tokens: int, num_kv_heads: int, device: torch.device, positional: bool = False,
                 live: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """policy: the SketchTopK for mode "sketch", the CascadeTopK for "cascade", else None (Quest's bound, or
        with positional the window's choice by position); live: h2o's live rows [L, k] and count [1]
        (StepEviction)."""
        self.policy, self.capacity, self.k, self.live = policy, capacity, k, live
        self.protected_max = sink_blocks + -(-recent_tokens // block_tokens) + 1  # blocks the window can protect
        self.window = dict(block_tokens=block_tokens, sink_blocks=sink_blocks, recent_tokens=recent_tokens)
        self.all_blocks = torch.arange(capacity, device=device).expand(num_kv_heads, capacity)  # [H, N] dense
        self._scores = quest_scores_live if device.type == "cuda" else quest_scores_live_ref
        # the sketch's masks of this token [N] (count): written in place, so that a graph of layer 0 alone
        # (kvstore/decode/layer_graphs.py) and the layers after it read the same tensors
        self._valid, self._protected = (torch.zeros(capacity, dtype=torch.bool, device=device)
                                        if isinstance(policy, SketchTopK) else None for _ in range(2))
        # the window's blocks of this token [H, k] (count), every layer's
        self._newest = torch.zeros((num_kv_heads, k), dtype=torch.int64, device=device) if positional else None

    def count(self, num_tokens: torch.Tensor, phase: str, kernel_tokens: torch.Tensor) -> None:
        """Once per token, from the device count int64 [1] (tokens before it): the tokens the kernel reads into
        kernel_tokens [1] (dense: all n once the token is appended; topk: k - 1 full blocks and the tail) and
        the sketch's masks of live and protected blocks."""
        n = num_tokens + 1  # [1]
        if phase == "dense":
            kernel_tokens.copy_(n)
            return
        b = self.window["block_tokens"]
        selected = self.k if self.live is None else self.live[1]  # blocks read, the partial tail the last
        kernel_tokens.copy_((selected - 1) * b + (n - 1) % b + 1)
        if isinstance(self.policy, SketchTopK):
            for mine, new in zip((self._valid, self._protected),
                                 live_and_protected(num_tokens, self.capacity, **self.window)):
                mine.copy_(new)
        elif self._newest is not None:  # by position; a protected block scores +inf, one past the count -inf
            live, protected = live_and_protected(num_tokens, self.capacity, **self.window)
            position = self.all_blocks[0].float()  # [N]
            scores = torch.where(protected, float("inf"), torch.where(live, position, float("-inf")))
            self._newest.copy_(top_blocks(scores[None], self.k).expand_as(self._newest))  # one row, every head

    def __call__(self, layer: int, table: LayerTable, q: torch.Tensor, phase: str, dense_blocks: int,
                 num_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(selected [H, k], slots int32 [H, k], is_int8 [H, k], the sketch's block upper bounds [Hq, N] or None)."""
        if phase == "dense":
            m, h = dense_blocks, self.all_blocks.shape[0]
            flags = table.tier_map[None, :m].expand(h, m)
            return self.all_blocks[:, :m], table.slot_map[None, :m].expand(h, m), flags, None
        n, k = self.capacity, self.k
        if self._newest is not None:
            return (self._newest, *block_table(table, self._newest), None)
        if self.live is not None:
            selected = self.live[0][layer].expand(self.all_blocks.shape[0], k)
            return (selected, *block_table(table, selected), None)
        if isinstance(self.policy, SketchTopK):
            selected, upper, gathered = self.policy.select_masked_table(
                q, table.summaries[:n], table.sketch[:n], self._valid, self._protected, k, table.slot_map,
                table.tier_map, WARM_TIER)
            return (selected, *(gathered or block_table(table, selected)), upper)
        scores = self._scores(q, table.summaries[:n], num_tokens, **self.window)  # [H, N]
        if isinstance(self.policy, CascadeTopK):
            tail = num_tokens // self.window["block_tokens"]  # [1]: the block this token goes into
            selected, gathered = self.policy.select_scored(q, table.summaries[:n], table.sketch[:n], scores, tail,
                                                           k, self.protected_max,
                                                           (table.slot_map, table.tier_map, WARM_TIER))
            return (selected, *(gathered or block_table(table, selected)), None)
        if scores.is_cuda and two_stage(n, k) and can_select(n, k):
            return (*topk_block_table(scores, k, table.slot_map, table.tier_map, WARM_TIER), None)
        selected = top_blocks(scores, k)
        return (selected, *block_table(table, selected), None)
