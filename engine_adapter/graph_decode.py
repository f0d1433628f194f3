"""Greedy decode of one or more sequences with each whole token captured as one CUDA graph.

A token's forward (engine_adapter/decode_forward.py) runs over the store's BatchStep: each sequence's append,
select and H2O accounting around one paged-attention launch for all of them. A graph is captured per graph
key (the membership, each sequence's phase: "dense" while it has at most k blocks, then "topk", and what
DecodeStep.graph_key adds) and replayed for every later token with that key; between tokens the host only
does the block-boundary work DecodeStep.begin_token names. Sequences in Quest's topk phase decoded together
go through rows instead (engine_adapter/row_decode.py: a join or a leave replays the graph it had).
On CPU the same forward runs eagerly (no graph).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine_adapter.decode_forward import decode_logits
from engine_adapter.llama import Llama
from engine_adapter.row_decode import RowDecoder, RowDecoders
from kvstore.decode.batch import BatchStep
from kvstore.decode.graphs import GraphedSteps
from kvstore.store import KVStore


class GraphDecoder:
    def __init__(self, model: Llama, store: KVStore, seqs: int | Sequence[int], mode: str = "topk",
                 budget: int = 4096, capacity_tokens: int | None = None) -> None:
        """`seqs`: one sequence, or several decoded together (each token of each one appended)."""
        self.seqs = (seqs,) if isinstance(seqs, int) else tuple(seqs)
        self.model, self.store = model, store
        self.step = BatchStep([store.decode_step(seq, mode=mode, budget=budget, capacity_tokens=capacity_tokens)
                               for seq in self.seqs])
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.tokens = torch.zeros(len(self.seqs), dtype=torch.long, device=self.device)  # [B] the input tokens
        self.steps = GraphedSteps(self.step, self._forward)

    def ready(self) -> bool:
        """False when the next token must go the eager way (blocks the step cannot serve, or capacity reached)."""
        return self.step.ready()

    def _forward(self) -> torch.Tensor:
        """fp32 logits [B, vocab] of each sequence's token at its next position, appending K/V in every layer."""
        return decode_logits(self.model, self.step, self.tokens)

    def __call__(self, tokens: int | Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Append each sequence's token (ints, or an int64 [B] tensor on the device: no host sync, so the host
        can queue the next token before this one ran) at its next position; returns fp32 logits [B, vocab]
        (a buffer the next call overwrites on CUDA: clone or consume it first)."""
        if isinstance(tokens, torch.Tensor):
            self.tokens.copy_(tokens.reshape(-1))
        elif isinstance(tokens, int):
            self.tokens.fill_(tokens)  # a launch with the id as its argument: no host-to-device copy
        else:
            self.tokens.copy_(torch.tensor(list(tokens), dtype=torch.long))
        return self.steps()


class GraphDecoders:
    """A Decoder's captured decoders: one GraphDecoder per (sequences, mode, budget), built on first use and
    rebuilt when a sequence's capacity runs out. A new batch replaces the batches its sequences were in (one
    graph set per live batch), and a table that moved (more capacity) drops every graph that captured it.
    Asked for rows, sequences that can all run in Quest's topk phase go through the row decoders instead
    (`rows`: a graph per bucket of rows and width, whatever the membership)."""

    def __init__(self, model: Llama, store: KVStore) -> None:
        self.model, self.store = model, store
        self.graphs: dict[tuple[tuple[int, ...], str, int], GraphDecoder] = {}  # (seqs, mode, budget) ->
        self.captures = 0  # CUDA graphs captured: a token that captures one runs twice as long as a replay
        self.rows = RowDecoders(model, store, self._count_capture)

    def get(self, seqs: Sequence[int], mode: str, budget: int,
            rows: bool = False) -> GraphDecoder | RowDecoder | None:
        """The decoder of (seqs, mode, budget), or None when these tokens must go another way (blocks the
        step cannot reach or dropped ones; not ready for another reason than capacity). rows: in the rows of
        a RowDecoder when every sequence can run there (mode "topk"), else by membership."""
        if rows and mode == "topk":
            decoder = self.rows.get(seqs, budget)
            if decoder is not None:
                return decoder
        key = (tuple(seqs), mode, budget)
        graph = self.graphs.get(key)
        if graph is not None:
            if graph.ready():
                return graph
            if all(s.length + 1 <= s.capacity * s.block_tokens for s in graph.step.steps):
                return None  # not for want of capacity (cold blocks, full GPU pools)
        layers = self.model.args.num_layers
        tables = [self.store.table(seq, i) for seq in seqs for i in range(layers)]
        if any(t.num_far or t.num_dropped for t in tables):
            return None

        def addresses() -> list[int]:  # where each table's tensors lie: a graph captured them there
            return [0 if t.summaries is None else t.summaries.data_ptr() for t in tables]

        before = addresses()
        graph = GraphDecoder(self.model, self.store, seqs, mode, budget)  # new, or more capacity
        graph.steps.on_capture = self._count_capture
        moved = {seqs[i // layers] for i, (old, new) in enumerate(zip(before, addresses())) if old != new}
        for other in list(self.graphs):
            members = set(other[0])
            if members & moved or (len(seqs) > 1 and len(members) > 1 and members & set(seqs)):
                del self.graphs[other]  # captured the tables' old tensors, or an old batch of these sequences
        self.graphs[key] = graph
        return graph

    def of(self, seq: int) -> list[GraphDecoder | RowDecoder]:
        """The decoders that step `seq`."""
        return [g for key, g in self.graphs.items() if seq in key[0]] + self.rows.of(seq)

    def drop(self, seq: int) -> None:
        for key in [k for k in self.graphs if seq in k[0]]:
            del self.graphs[key]
        self.rows.drop(seq)

    def _count_capture(self) -> None:
        self.captures += 1
