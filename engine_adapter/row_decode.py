"""Row decoders: sequences in Quest's topk phase decoded together in the rows of a SlotBatch
(kvstore/decode/batch_slots.py), so that a join or a leave between tokens replays the graph the rows had.

RowDecoders keeps a RowDecoder per (budget, rows R, width W) it has used and, per budget, the active one that
holds the sequences of the last token. For a token of some sequences:
  - a member not decoded now, or whose capacity ran out, or whose tables moved, leaves its row;
  - a new sequence joins a free row (with a DecodeStep of its own capacity: its length + max(16K, 1/16));
  - only when the sequences outnumber the rows (the rows then at least double: 1, 2, 4, 8, then multiples of
    8, as engines pad their graph batch sizes), fill less than a quarter of them, or a table outgrows the
    width (blocks, in quarter-octave buckets) do the members move, DecodeSteps and all, to the decoder of the
    new buckets: built once, its graphs captured once and replayed from then on.
A join or a leave within the buckets captures nothing, whether the sequence holds cpu-tier blocks or not (the
rows' staging launch reads each row's tables through its addresses). Sequences that cannot run in rows (a
dense phase, blocks beyond the cpu tier) go by membership (GraphDecoders).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine_adapter.decode_forward import decode_logits
from engine_adapter.llama import Llama
from kvstore.decode.batch_slots import SlotBatch, serves_next_token
from kvstore.decode.graphs import GraphedSteps
from kvstore.decode.step import DecodeStep
from kvstore.decode.step_parts import topk_blocks
from kvstore.store import KVStore
from tiers.base import device_ints


def row_bucket(n: int) -> int:
    """Rows for n sequences: 1, 2, 4, 8, then multiples of 8."""
    return 1 << (n - 1).bit_length() if n <= 8 else -(-n // 8) * 8


def width_bucket(n: int) -> int:
    """Score width for tables of up to n blocks: n rounded up to a quarter octave (at most 25% more)."""
    step = 1 << max(0, n.bit_length() - 3)
    return -(-n // step) * step


class RowDecoder:
    """The captured token of one SlotBatch: the model's forward over its R rows (decode_forward.py), one graph
    per SlotBatch.graph_key, whoever sits in the rows."""

    def __init__(self, model: Llama, batch: SlotBatch, on_capture: Callable[[], None]) -> None:
        self.model, self.step = model, batch
        self.device = model.embed_tokens.weight.device
        self.tokens = torch.zeros(batch.num_rows, dtype=torch.long, device=self.device)  # [R] the input tokens
        self.steps = GraphedSteps(batch, self._forward)
        self.steps.on_capture = on_capture
        self.seqs: tuple[int, ...] = ()  # the sequences of the next call, in its order
        self._rows: list[int] = []  # their rows
        self._order = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] the same, on the device

    def ready(self) -> bool:
        return self.step.ready()

    def arrange(self, seqs: Sequence[int]) -> None:
        """The next calls decode `seqs` (members), their tokens given and their logits returned in this order."""
        rows = [self.step.row_of(seq) for seq in seqs]
        if rows != self._rows:
            self._rows, self._order = rows, device_ints(rows, self.device)
        self.seqs = tuple(seqs)

    def join(self, step: DecodeStep) -> None:
        self.step.join(step)

    def leave(self, seq: int) -> DecodeStep:
        """Empty seq's row (the graphs stay: they read its row's addresses, not its tables). Returns its
        DecodeStep."""
        step = self.step.leave(seq)
        if seq in self.seqs:
            self.seqs, self._rows = (), []
        return step

    def _forward(self) -> torch.Tensor:
        return decode_logits(self.model, self.step, self.tokens)

    def __call__(self, tokens: int | Sequence[int]) -> torch.Tensor:
        """Append each arranged sequence's token at its next position; fp32 logits [B, vocab] in arrange's order
        (empty rows decode token 0 on scratch state; their logits are dropped here)."""
        tokens = [tokens] if isinstance(tokens, int) else list(tokens)
        if len(tokens) != len(self.seqs):
            raise ValueError(f"RowDecoder: {len(self.seqs)} sequences arranged, {len(tokens)} tokens given")
        ids = [0] * self.step.num_rows
        for row, token in zip(self._rows, tokens):
            ids[row] = int(token)
        self.tokens.copy_(device_ints(ids, self.device))
        return self.steps().index_select(0, self._order)


class RowDecoders:
    def __init__(self, model: Llama, store: KVStore, on_capture: Callable[[], None]) -> None:
        self.model, self.store, self.on_capture = model, store, on_capture
        self.decoders: dict[tuple[int, int, int], RowDecoder] = {}  # (budget, rows, width) -> its decoder
        self.active: dict[int, RowDecoder] = {}  # budget -> the decoder holding the last token's sequences

    def get(self, seqs: Sequence[int], budget: int) -> RowDecoder | None:
        """The RowDecoder arranged for `seqs` (mode "topk" at `budget`), its members changed to them (host work
        between tokens); None, changing nothing, when a new sequence cannot run in rows (module docstring)."""
        c, layers = self.store.config, range(self.store.spec.num_layers)
        active = self.active.get(budget)
        members = {} if active is None else {m.seq: m for m in active.step.members if m is not None}
        k = topk_blocks(budget, c.block_tokens, -(-c.sink_tokens // c.block_tokens),
                        self.store.decode.recent_window(budget))
        moved = set(active.step.moved()) if active is not None else set()
        kept = {seq: step for seq, step in members.items()  # a full one joins again with more capacity
                if seq in seqs and seq not in moved and step.length + 1 <= step.capacity * step.block_tokens}
        tables = lambda seq: [self.store.table(seq, i) for i in layers]  # noqa: E731
        if not all(serves_next_token(tables(seq), k, c.block_tokens) for seq in seqs if seq not in kept):
            return None
        for seq in members:
            if seq not in kept:
                active.leave(seq)
        joining = [self.store.decode_step(seq, "topk", budget) for seq in seqs if seq not in kept]
        # the widest table: the kept members' fit the active width (a table that grew has moved, and left)
        width = max(([active.step.width] if kept else []) +
                    [max(s.capacity, *(t.summaries.shape[0] for t in s.tables)) for s in joining])
        target = self._target(active, budget, len(seqs), width, (list(kept.values()) + joining)[0])
        if target is not active:
            for seq in kept:  # every member moves, DecodeStep and all
                target.join(active.leave(seq))
            self.active[budget] = target
        for step in joining:
            target.join(step)
        target.arrange(seqs)
        return target

    def _target(self, active: RowDecoder | None, budget: int, n: int, width: int,
                template: DecodeStep) -> RowDecoder:
        """The decoder for n sequences with tables of up to `width` blocks: the active one while its buckets
        hold them, else the one of the new buckets (the narrowest width built already that holds them)."""
        rows = row_bucket(n)
        if active is not None:
            have = active.step.num_rows
            if have // 4 <= n <= have and width <= active.step.width:
                return active  # at least a quarter of the rows used
            if n > have:  # growing: at least twice the rows, so a rising load captures log-many times
                rows = row_bucket(max(n, 2 * have))
        widths = [w for b, r, w in self.decoders if (b, r) == (budget, rows) and w >= width]
        key = (budget, rows, min(widths) if widths else width_bucket(width))
        if key not in self.decoders:
            self.decoders[key] = RowDecoder(self.model, SlotBatch(rows, key[2], template), self.on_capture)
        return self.decoders[key]

    def of(self, seq: int) -> list[RowDecoder]:
        """The row decoders holding `seq` (at most one per budget)."""
        return [d for d in self.active.values() if seq in d.step.seqs]

    def drop(self, seq: int) -> None:
        """`seq` leaves its rows (its sequence is freed)."""
        for decoder in self.of(seq):
            decoder.leave(seq)
