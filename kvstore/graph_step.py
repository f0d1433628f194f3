"""A top-K decode step captured in a CUDA graph: one replay per layer and step.

A sparse step at 1M tokens reads ~1/30 of what a dense step reads, so launch and
Python overhead would dominate it (ANCHORS.md: sparse steps are launch-bound). This
captures select -> block table -> paged attention -> H2O accounting for one
(sequence, layer) at its current length, with every block GPU-resident. Appending
to the sequence invalidates the capture: build a new one (or use store.attend).
"""

from __future__ import annotations

import torch

from eviction.topk import TopK
from kvstore.attention.paged_decode import paged_decode
from kvstore.decode import block_table, tokens_covered
from kvstore.store import KVStore
from kvstore.table import DROPPED


class GraphedTopK:
    def __init__(self, store: KVStore, seq: int, layer: int, budget: int) -> None:
        table = store.table(seq, layer)
        if store.device.type != "cuda":
            raise ValueError(f"GraphedTopK needs a CUDA store, got device {store.device}")
        if table.num_cold or DROPPED in table.block_ids or not table.num_tokens:
            raise ValueError("GraphedTopK needs a non-empty table whose blocks are all on the GPU (hot or warm)")
        self.store, self.table, self.budget, self.policy = store, table, budget, TopK()
        self.num_blocks, self.length = table.num_blocks, table.num_tokens
        self.q = torch.zeros((store.spec.num_q_heads, store.spec.head_dim), dtype=torch.float16, device=store.device)
        self.ctx = store.decode.context(table, self.q, budget)  # the capture reads self.q in place
        covered = tokens_covered(table, self.ctx.num_selected(budget), store.config.block_tokens)
        self.num_tokens = torch.tensor([covered], dtype=torch.int32, device=store.device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile and warm up outside the capture
            for _ in range(2):
                self._step(account=False)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._step(account=True)

    def _step(self, account: bool) -> torch.Tensor:
        t, tiers = self.table, self.store.tiers
        selected = self.policy.select(self.ctx, self.budget)  # [H, k]
        slots, is_int8 = block_table(t, selected)
        warm = tiers.warm.pool
        out, mass = paged_decode(self.q[None], tiers.hot.pool, warm.data, warm.k_scale, warm.v_scale, slots[None],
                                 is_int8[None], self.num_tokens, return_block_mass=True)
        if account:
            t.h2o_scores[:, : self.num_blocks].scatter_add_(1, selected, mass[0])
        return out[0]

    def __call__(self, q: torch.Tensor) -> torch.Tensor:
        """q [num_q_heads, head_dim] fp16 -> out [num_q_heads, head_dim]; the output buffer is reused."""
        if self.table.num_tokens != self.length or self.table.num_cold:
            raise ValueError("the sequence changed since capture (appended or cooled to cpu): capture again")
        self.q.copy_(q)
        self.graph.replay()
        return self.out


