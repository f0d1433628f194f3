"""One greedy decode step of a whole model over a fixed context, captured as one CUDA graph.

kvstore.graph_step.GraphedTopK captures one layer's sparse attention; a whole decode step
also runs 32 layers of projections, norms and MLPs around it, and launched eagerly those
cost more than the attention does. StaticStep captures embedding -> every layer (q
projection, top-K select or the dense table, paged attention over the store's blocks, MLP)
-> logits -> argmax, feeding the argmax back as the next input token.

The context is fixed: the step does not append its own K/V (appending changes the block
tables, which a graph cannot follow). The e2e suite reports this as decode speed at a
given context and measures appends separately. On CPU the same step runs eagerly.
"""

from __future__ import annotations

import torch

from engine_adapter.llama import Llama
from eviction.topk import TopK
from kvstore.decode import block_table, tokens_covered
from kvstore.store import KVStore
from kvstore.table import DROPPED

MODES = ("dense", "topk")


class StaticStep:
    def __init__(self, model: Llama, store: KVStore, seq: int, mode: str, budget: int = 4096) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.tables = [store.table(seq, i) for i in range(store.spec.num_layers)]
        if any(t.num_cold or DROPPED in t.block_ids for t in self.tables):
            raise ValueError("StaticStep needs every block of the sequence on the GPU (hot or warm), none dropped")
        self.model, self.store, self.mode, self.budget = model, store, mode, budget
        dev, t = store.device, self.tables[0]
        self.num_blocks, self.policy = t.num_blocks, TopK()
        num_q_heads, head_dim = store.spec.num_q_heads, store.spec.head_dim
        self.q = torch.zeros((len(self.tables), num_q_heads, head_dim), dtype=torch.float16, device=dev)  # [L, Hq, D]
        self.contexts = [store.decode.context(table, self.q[i], budget) for i, table in enumerate(self.tables)]
        k = self.contexts[0].num_selected(budget) if mode == "topk" else t.num_blocks
        self.num_tokens = torch.tensor([tokens_covered(t, k, store.config.block_tokens)], dtype=torch.int32,
                                       device=dev)
        dtype = model.embed_tokens.weight.dtype
        self.cos, self.sin = model.rope(torch.tensor([t.num_tokens], device=dev), dtype)  # [1, D] each
        self.token = torch.zeros(1, dtype=torch.long, device=dev)  # [1]: input of the next step
        self.dense = [self._dense_table(t) for t in self.tables] if mode == "dense" else None
        self.graph = None
        if dev.type == "cuda":
            self._capture()

    def _dense_table(self, t) -> tuple[torch.Tensor, torch.Tensor]:
        n, h = self.num_blocks, self.store.spec.num_kv_heads
        slots, is_int8 = block_table(t, torch.arange(n, device=self.store.device).expand(h, n))
        return slots[None], is_int8[None]  # [1, H, n] each

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [Hq, D] fp16 -> out [Hq, D] over the layer's dense table or its top-K blocks."""
        t, tiers = self.tables[layer], self.store.tiers
        if self.mode == "topk":
            self.q[layer].copy_(q)  # the layer's ScoreContext reads it
            slots, is_int8 = (x[None] for x in block_table(t, self.policy.select(self.contexts[layer], self.budget)))
        else:
            slots, is_int8 = self.dense[layer]
        w = tiers.warm.pool
        out, _ = self.store.decode.kernel(q[None], tiers.hot.pool, w.data, w.k_scale, w.v_scale, slots, is_int8,
                                          self.num_tokens)
        return out[0]

    @torch.inference_mode()
    def _forward(self) -> torch.Tensor:
        x = self.model.embed_tokens(self.token)  # [1, dim]
        for i, layer in enumerate(self.model.layers):
            q, _, _ = layer.qkv(x, self.cos, self.sin)  # [1, Hq, D]
            x = layer.finish(x, self._attend(i, q[0].half())[None])
        logits = self.model.logits(x)[0]  # [vocab] fp32
        self.token.copy_(logits.argmax(-1, keepdim=True))
        return logits

    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile and warm up outside the capture
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._forward()

    def run(self, steps: int, first_token: int) -> list[int]:
        """`steps` greedy steps from first_token; returns the tokens produced (one host sync, at the end)."""
        self.token.fill_(first_token)
        produced = []
        for _ in range(steps):
            if self.graph is not None:
                self.graph.replay()
            else:
                self._forward()
            produced.append(self.token.clone())
        return [int(t) for t in torch.cat(produced).tolist()]

    def logits_for(self, token: int) -> torch.Tensor:
        """fp32 [vocab] of one step from `token` (for checks against the eager path)."""
        self.token.fill_(token)
        if self.graph is None:
            return self._forward().clone()
        self.graph.replay()
        return self.logits.clone()
