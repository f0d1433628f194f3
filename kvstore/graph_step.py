"""A top-K decode step captured in a CUDA graph: one replay per layer and step.

A sparse step at 1M tokens reads ~1/30 of what a dense step reads, so launch and
Python overhead would dominate it (ANCHORS.md: sparse steps are launch-bound). This
captures select -> block table -> paged attention -> H2O accounting for one
(sequence, layer) at its current length, with every block GPU-resident. Appending
to the sequence invalidates the capture: build a new one (or use store.attend).
"""

from __future__ import annotations

import torch

from kvstore.attention.paged_decode import paged_decode
from eviction.select import num_selected
from eviction.topk import topk_select
from kvstore.decode import recent_window
from kvstore.placement import WARM
from kvstore.store import KVStore
from kvstore.table import DROPPED


class GraphedTopK:
    def __init__(self, store: KVStore, seq: int, layer: int, budget: int) -> None:
        table = store.table(seq, layer)
        if store.device.type != "cuda":
            raise ValueError(f"GraphedTopK needs a CUDA store, got device {store.device}")
        if table.num_cold or DROPPED in table.block_ids or not table.num_tokens:
            raise ValueError("GraphedTopK needs a non-empty table whose blocks are all on the GPU (hot or warm)")
        c = store.config
        self.store, self.table, self.budget = store, table, budget
        self.num_blocks, self.length = table.num_blocks, table.num_tokens
        self.counts = dict(num_tokens=table.num_tokens, block_tokens=c.block_tokens, sink_tokens=c.sink_tokens,
                           recent_tokens=recent_window(store, budget))
        k = num_selected(budget_tokens=budget, **self.counts)
        covered = (k - 1) * c.block_tokens + table.num_tokens - (table.num_blocks - 1) * c.block_tokens
        self.num_tokens = torch.tensor([covered], dtype=torch.int32, device=store.device)
        self.q = torch.zeros((store.spec.num_q_heads, store.spec.head_dim), dtype=torch.float16, device=store.device)
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
        t, s = self.table, self.store
        selected = topk_select(self.q, t.summaries[: self.num_blocks], budget_tokens=self.budget, **self.counts)
        slots = t.slot_map[selected]  # [H, k]
        is_int8 = t.level_map[selected] == WARM
        warm = s.warm.pool
        out, mass = paged_decode(self.q[None], s.hot.pool, warm.data, warm.k_scale, warm.v_scale, slots[None],
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


