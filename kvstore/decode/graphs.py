"""GraphedSteps: a DecodeStep's token (a model's layers around step.attend) replayed as one CUDA graph.

A graph is captured per DecodeStep.graph_key() (the phase, whether the token stages cpu blocks, the cpu
tier's slab generation and, dense, the table's bucket and whether any block is warm) and replayed for every
later token with that key; between tokens only the host work DecodeStep.begin_token / end_token names runs.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvstore.decode.step import DecodeStep


class GraphedSteps:
    """Runs `forward` (one token's device work over `step`, e.g. a model's layers around step.attend) with
    the host work around it, as one CUDA graph replay per step.graph_key() (phase, cpu blocks staged or
    not, the cpu slab generation, the dense bucket, any block warm); eagerly off CUDA, where the keys and
    captures are counted all the same. `step`: a DecodeStep, or a BatchStep or SlotBatch (the same host calls).

    The first token of a phase runs for real on a side stream (compiling every kernel), then the same
    forward is recorded; recording runs nothing, so that token runs once."""

    def __init__(self, step: DecodeStep, forward: Callable[[], torch.Tensor]) -> None:
        self.step, self.forward = step, forward
        # graph_key -> (graph, output) on CUDA; elsewhere None (the keys a GPU would have captured)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor] | None] = {}
        self.captures = 0  # graphs captured so far (each: one token run eagerly, then recorded; off CUDA: keys)
        self.on_capture: Callable[[], None] | None = None  # told of each capture (Decoder counts them)

    def __call__(self) -> torch.Tensor:
        """The forward's output (on CUDA a buffer the next call overwrites: clone to keep)."""
        self.step.begin_token()
        key = self.step.graph_key()
        if key not in self.graphs:
            out = self._capture(key)
        elif self.step.device.type == "cuda":
            graph, out = self.graphs[key]
            graph.replay()
        else:
            out = self.forward()
        self.step.end_token()
        return out

    def _capture(self, key: tuple) -> torch.Tensor:
        """A new key: counted and recorded on every device (so the decision is observable off CUDA), captured on
        CUDA (the forward runs eagerly elsewhere)."""
        self.captures += 1
        if self.on_capture is not None:
            self.on_capture()
        drop_stale(self.graphs, key, 2)
        if self.step.device.type != "cuda":
            self.graphs[key] = None
            return self.forward()
        out = run_warm(self.forward)
        self.graphs[key] = record(self.forward)
        return out


def drop_stale(graphs: dict[tuple, object], key: tuple, fixed: int) -> None:
    """Before recording `key`: the graphs whose key shares its first `fixed` parts (the phase and whether cpu
    blocks are staged) and differs in the rest go (the cpu tier's slabs moved since, or the dense table outgrew
    its bucket): they are never replayed again."""
    for stale in [k for k in graphs if k[:fixed] == key[:fixed]]:
        del graphs[stale]


def run_warm(forward: Callable[[], torch.Tensor]) -> torch.Tensor:
    """forward() run for real on a side stream, where its kernels compile outside any capture; its output
    cloned."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = forward().clone()
    torch.cuda.current_stream().wait_stream(stream)
    return out


def record(forward: Callable[[], torch.Tensor],
           pool: tuple | None = None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """forward recorded into a new CUDA graph (recording runs nothing): (graph, the output its replays write).
    thread_local: a background save's or load's thread may call CUDA (events, pinned copies) meanwhile."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        recorded = forward()
    return graph, recorded
