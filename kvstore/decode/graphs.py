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
    not, the cpu slab generation, the dense bucket, any block warm); eagerly off CUDA.

    The first token of a phase runs for real on a side stream (compiling every kernel), then the same
    forward is recorded; recording runs nothing, so that token runs once."""

    def __init__(self, step: DecodeStep, forward: Callable[[], torch.Tensor]) -> None:
        self.step, self.forward = step, forward
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # graph_key -> (graph, output)
        self.captures = 0  # graphs captured so far (each: one token run eagerly, then recorded)
        self.on_capture: Callable[[], None] | None = None  # told of each capture (Decoder counts them)

    def __call__(self) -> torch.Tensor:
        """The forward's output (on CUDA a buffer the next call overwrites: clone to keep)."""
        self.step.begin_token()
        key = self.step.graph_key()
        if self.step.device.type != "cuda":
            out = self.forward()
        elif key in self.graphs:
            graph, out = self.graphs[key]
            graph.replay()
        else:
            out = self._capture(key)
        self.step.end_token()
        return out

    def _capture(self, key: tuple) -> torch.Tensor:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = self.forward().clone()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        self.captures += 1
        if self.on_capture is not None:
            self.on_capture()
        with torch.cuda.graph(graph):
            recorded = self.forward()
        for stale in [k for k in self.graphs if k[:2] == key[:2]]:  # the cpu tier's slabs moved since, or the
            del self.graphs[stale]  # dense table outgrew its bucket: never replayed again
        self.graphs[key] = (graph, recorded)
        return out

