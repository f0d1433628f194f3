"""BatchRows: a batch's topk-phase append, Quest selection and H2O accounting, one launch each per layer.

Per sequence, DecodeStep.select and DecodeStep.account take four launches a layer (append, Quest scores, two
top-k stages) and one more for the H2O mass; in a 12-sequence token of 32 layers that is ~1,900 graph nodes
of a few microseconds each. BatchRows runs the same arithmetic for every sequence in one launch per kernel
(eviction/batch_kernels.py), each program reading its sequence's table tensors through int64 address arrays
[L, B] built here once per batch membership: a decode step reserves its tables at a fixed capacity, and a
table that moves (GraphDecoders rebuilds the batch then) never reaches a BatchRows built before the move.

It serves a token when every sequence is in the topk phase of Quest's bound (mode "topk"); the sketch, a
dense phase and a phase change inside the batch go sequence by sequence (DecodeStep.select). A row selects
exactly the blocks its sequence selects alone: the same tile code and threshold top-k per row on CUDA, the
same torch references (one sequence at a time) on CPU.
"""

from __future__ import annotations

import torch

from eviction.batch_kernels import (add_mass_rows, add_mass_rows_ref, addresses, quest_scores_rows,
                                    quest_scores_rows_ref, topk_table_rows, topk_table_rows_ref)
from eviction.topk_kernel import can_select
from kvstore.attention.append import append_tokens, append_tokens_ref
from kvstore.blocks.tierset import WARM_TIER
from kvstore.decode.step import DecodeStep


class BatchRows:
    def __init__(self, steps: list[DecodeStep]) -> None:
        first, dev = steps[0], steps[0].device
        self.steps, self.k, self.cuda = steps, first.k, dev.type == "cuda"
        self.pool = first.tiers.hot.pool
        self.width = max(s.capacity for s in steps)  # blocks per score row: the widest table
        layers = range(len(first.tables))
        tables = [[s.tables[layer] for s in steps] for layer in layers]  # [L][B]
        self.summaries = [[t.summaries for t in row] for row in tables]
        self.slot_maps = [[t.slot_map for t in row] for row in tables]
        self.tier_maps = [[t.tier_map for t in row] for row in tables]
        self.h2o = [[t.h2o_scores for t in row] for row in tables]
        self.sum_addrs = torch.stack([addresses(row, dev) for row in self.summaries])  # int64 [L, B]
        self.slot_addrs = torch.stack([addresses(row, dev) for row in self.slot_maps])
        self.tier_addrs = torch.stack([addresses(row, dev) for row in self.tier_maps])
        self.h2o_addrs = torch.stack([addresses(row, dev) for row in self.h2o])
        self.h2o_strides = torch.tensor([[t.stride(0) for t in row] for row in self.h2o], dtype=torch.int64,
                                        device=dev)  # [L, B]
        b, h = len(steps), first.spec.num_kv_heads
        self.counts = torch.zeros(b, dtype=torch.int64, device=dev)  # [B] tokens before this one
        self.tail_slots = torch.zeros((len(layers), b), dtype=torch.int64, device=dev)  # [L, B]
        self.scores = torch.empty((b, h, self.width), dtype=torch.float32, device=dev)  # [B, H, N]
        self.window = dict(block_tokens=first.block_tokens, sink_blocks=first.sink_blocks,
                           recent_tokens=first.recent_tokens)

    def serves(self) -> bool:
        """Whether this token goes through the batched launches (host-known at begin_token: every sequence in
        the topk phase of Quest's bound, rows that fit the top-k kernel)."""
        return all(s.phase == "topk" and s.policy is None for s in self.steps) and can_select(self.width, self.k)

    def select(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append k, v [B, H, D] of every sequence's token at `layer`, select each one's k blocks and stage its
        selected cpu blocks: (selected int64, slots int32, is_int8 bool), each [B, H, k]. Layers run in order."""
        if layer == 0:  # what depends only on the token: each step's kernel token count, the batch's counts
            for s in self.steps:
                s.count_tokens()
            torch.cat([s.num_tokens for s in self.steps], out=self.counts)
            torch.stack([s.tail_slot for s in self.steps], dim=1, out=self.tail_slots)
        summaries = self.summaries[layer]
        if self.cuda:
            append_tokens(self.pool, summaries, self.sum_addrs[layer], k, v, self.tail_slots[layer], self.counts)
            scores = quest_scores_rows(q, summaries, self.sum_addrs[layer], self.counts, self.width,
                                       out=self.scores, **self.window)
            picked = topk_table_rows(scores, self.k, self.slot_addrs[layer], self.tier_addrs[layer],
                                     (self.slot_maps[0][0], self.tier_maps[0][0]), WARM_TIER)
        else:
            append_tokens_ref(self.pool, summaries, k, v, self.tail_slots[layer], self.counts)
            scores = quest_scores_rows_ref(q, summaries, self.counts, self.width, **self.window)
            picked = topk_table_rows_ref(scores, self.k, self.slot_maps[layer], self.tier_maps[layer], WARM_TIER)
        selected, slots, is_int8 = picked
        for i, s in enumerate(self.steps):  # selected cpu blocks into each sequence's own staging rows
            if s.stages_cold:
                s.cold.stage(layer, s.tables[layer], selected[i], slots[i], is_int8[i])
        return picked

    def account(self, layer: int, selected: torch.Tensor, mass: torch.Tensor) -> None:
        """The kernel's block mass [B, H, >= k] into every sequence's H2O scores; after the last layer each
        sequence's device count moves on."""
        if self.cuda:
            add_mass_rows(mass, selected, self.h2o_addrs[layer], self.h2o[0][0], self.h2o_strides[layer])
        else:
            add_mass_rows_ref(mass, selected, self.h2o[layer])
        for s in self.steps:
            s.advance(layer)
