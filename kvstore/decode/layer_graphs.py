"""LayerGraphs: a DecodeStep's layer (append + select + stage + attend + account) replayed as one CUDA graph.

store.append + store.attend run a decode token through the sequence's DecodeStep one layer at a time
(eager_step.py), between the layers of a model the store does not see. Launched one by one, a layer's step is
a dozen kernel launches and their Python (~1 ms of host time a layer); replayed, it is two input copies, one
replay and one output copy. A graph is recorded per (layer, DecodeStep.graph_key()): the key says what a
captured token depends on beyond device state (phase, cpu blocks staged, the cpu slab generation, the dense
bucket, any block warm), so the graphs stay valid while the sequence grows, exactly as the whole-token graph
of GraphedSteps (graphs.py) does. All of a step's graphs share one memory pool: they replay one after another.

The first token of a key runs each layer for real on a side stream (compiling its kernels), then records it;
recording runs nothing, so that layer runs once. Off CUDA the layer runs eagerly and the keys are counted all
the same, so the bookkeeping is tested where no GPU is.
"""

from __future__ import annotations

import warnings

import torch

from kvstore.decode.graphs import drop_stale, record, run_warm
from kvstore.decode.step import DecodeStep


class LayerGraphs:
    def __init__(self, step: DecodeStep) -> None:
        self.step = step
        spec, dev = step.spec, step.device
        self.q = torch.zeros(spec.num_q_heads, spec.head_dim, dtype=torch.float16, device=dev)  # static inputs
        self.kv = torch.zeros(2, spec.num_kv_heads, spec.head_dim, dtype=torch.float16, device=dev)
        # (layer, *graph_key) -> (graph, its output) on CUDA; elsewhere None (the keys a GPU would have recorded)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor] | None] = {}
        self.captures = 0
        self.failed: RuntimeError | None = None  # a capture CUDA refused: every layer is launched from then on
        self.pool = torch.cuda.graph_pool_handle() if dev.type == "cuda" else None

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """step.attend(layer, q, k, v) of kv = [k, v] [2, H, D] (self.kv itself: no copy) -> [Hq, D] (a tensor of
        the caller's)."""
        step = self.step
        if self.failed is not None:
            return step.attend(layer, q, kv[0], kv[1])
        if step.device.type != "cuda":
            self._count((layer, *step.graph_key()))
            return step.attend(layer, q, kv[0], kv[1])
        key = (layer, *step.graph_key())
        self.q.copy_(q)
        if kv is not self.kv:  # layer 0's K/V were kept before the step (and its graphs) was known
            self.kv.copy_(kv)
        if key not in self.graphs:
            return self._capture(key, layer)
        graph, out = self.graphs[key]
        graph.replay()
        step.expect_layer(layer + 1)
        return out.clone()  # the next token's replay rewrites the graph's output

    def _count(self, key: tuple) -> None:
        if key not in self.graphs:
            self.captures += 1
            drop_stale(self.graphs, key, 3)  # (layer, phase, cpu blocks staged)
            self.graphs[key] = None

    def _capture(self, key: tuple, layer: int) -> torch.Tensor:
        self._count(key)
        step = self.step

        def forward() -> torch.Tensor:
            return step.attend(layer, self.q, self.kv[0], self.kv[1])
        try:
            out = run_warm(forward)
        except BaseException:  # nothing recorded: the next token of this key tries again
            del self.graphs[key]
            raise
        step.expect_layer(layer)  # recording passes through the layer's select again
        try:
            self.graphs[key] = record(forward, self.pool)
        except RuntimeError as exc:  # CUDA refused the capture: the layer ran (out is right); launch from now on
            del self.graphs[key]
            step.expect_layer(layer + 1)
            self.failed = exc
            warnings.warn(f"kvtier: store.attend launches this sequence's step kernel by kernel, its layer could "
                          f"not be captured: {exc}", RuntimeWarning, stacklevel=2)
        return out
