"""SlotBatch: R rows of Quest-topk decoding whose sequences join and leave between tokens under one captured graph.

BatchStep (batch.py) reads each sequence's device state where its own DecodeStep keeps it, so a captured token
is valid for one membership. Here the batch owns the device state of its rows, and a member's DecodeStep keeps
its count, tail slots and kernel token count in views of its row (DecodeStep.bind_state):

    counts          int64 [R]        tokens before this one (a member's num_tokens)
    live            int64 [R]        1 where a member sits
    tail_slots      int64 [L, R]     hot-pool slot of each layer's tail block (a member's tail_slot)
    kernel_tokens   int32 [R]        tokens the attention kernel reads (0: the row reads nothing)
    addresses       int64 [7, L, R]  each row's tensors per layer: summaries, slot map, tier map, H2O scores,
                                     H2O row stride (eviction/batch_kernels.py reads them), the member's cpu
                                     slice reads of the layer and its damage counters (StepColdBlocks: reads,
                                     counts; tiers/slice_gather.py reads them)
    staging_rows    int64 [R]        first of the row's k staging rows (its lane), -1: none

Per layer of a token, as BatchRows: one launch each appends every row's token, scores Quest's bound over W
blocks and selects k blocks per kv head; one launch stages every row's selected cpu blocks into its lane,
verified against their per-head sums and counted in its member's counters (empty rows, rows without a lane
and rows whose tables hold no cpu block stage nothing); one paged-kernel launch attends every row; one launch
adds the block mass to the H2O scores; the last layer moves the counts of live rows on. None of it depends on
which sequence sits in which row: a join or a leave writes one row's state and addresses between tokens and
the captured graph replays as it is, whether the member holds cpu blocks or not. The graph key holds only what
the launches depend on: R, W and the cpu tier's generation (its per-head sums are a tier-wide tensor that the
tier reallocates, doubling, as it grows: a graph over the old one would read freed memory; a new slab joins the
slab table in place).

An empty row reads and writes nothing of any sequence: kernel token count 0, count 0, its tail slot the hot
tier's scratch row and its tables the batch's scratch table (one summary entry, as a count of 0 reads block 0
only; a slot map of W entries, all the scratch row, hot; H2O scores [H, W]); its logits are to be ignored.

Members: sequences in Quest's topk phase from their next token on (mode "topk" with Quest's bound alone),
nothing beyond the cpu tier, tables of at most W blocks. A row's arithmetic is its sequence's alone: on CPU the
torch references (one sequence at a time) give what its DecodeStep gives by itself, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from eviction.batch_kernels import (add_mass_rows, add_mass_rows_ref, quest_scores_rows, quest_scores_rows_ref,
                                    topk_table_rows, topk_table_rows_ref)
from eviction.topk_kernel import can_select
from kvstore.attention.append import append_tokens, append_tokens_ref
from kvstore.blocks.table import LayerTable
from kvstore.blocks.tierset import CPU_TIER, HOT_TIER, WARM_TIER
from kvstore.decode.batch import begin_steps, steps_ready
from kvstore.decode.readiness import cool_ahead
from kvstore.decode.step import DecodeStep, StepNotReady
from tiers.base import IntegrityError, device_ints
from tiers.block_rows import fields, normal_device
from tiers.slice_gather import stage_cold_slices_rows

RowTensors = tuple[torch.Tensor, ...]  # a row's at one layer: summaries, slot, tier maps, H2O, cpu reads, counts


def serves_next_token(tables: list[LayerTable], k: int, block_tokens: int) -> bool:
    """Whether a sequence's next token can run in a SlotBatch selecting k blocks: past its dense phase (more
    than k blocks), nothing beyond the cpu tier, nothing dropped."""
    n = tables[0].num_tokens + 1
    return -(-n // block_tokens) > k and not any(t.num_far or t.num_dropped for t in tables)


class SlotBatch:
    def __init__(self, num_rows: int, width: int, template: DecodeStep) -> None:
        """num_rows rows (R), score rows of `width` blocks (W); mode, budget, pools and windows those of
        `template` (a DecodeStep of mode "topk"; it does not join)."""
        t = template
        if t.mode != "topk" or t.policy is not None:
            raise ValueError(f"SlotBatch serves mode 'topk' (Quest's bound), got {t.mode!r}")
        if num_rows <= 0 or not 0 < t.k <= width or not can_select(width, t.k):
            raise ValueError(f"SlotBatch needs rows > 0 and a width the top-k kernel holds for k {t.k}, got "
                             f"{num_rows} rows of {width} blocks")
        self.num_rows, self.width, self.k, self.budget = num_rows, width, t.k, t.budget
        self.tiers, self.tensors, self.path, self.device = t.tiers, t.tensors, t.path, t.device
        self.block_tokens, self.cuda = t.block_tokens, t.device.type == "cuda"
        self.window = dict(block_tokens=t.block_tokens, sink_blocks=t.sink_blocks, recent_tokens=t.recent_tokens)
        spec, dev, r = t.spec, t.device, num_rows
        self.num_layers, h, d = spec.num_layers, spec.num_kv_heads, spec.head_dim
        self.scratch_slot = self.tiers.hot.scratch_slot
        self.scratch: RowTensors = (
            torch.zeros((1, 2, h, d), dtype=torch.float16, device=dev),  # [1, 2, H, D]: a count of 0 reads block 0
            torch.full((width,), self.scratch_slot, dtype=torch.int32, device=dev),  # [W]
            torch.full((width,), HOT_TIER, dtype=torch.int8, device=dev),  # [W]: nothing in the cpu tier
            torch.zeros((h, width), dtype=torch.float32, device=dev),  # [H, W]
            torch.zeros(width, dtype=torch.int32, device=dev),  # [W] cpu slice reads (none)
            torch.zeros(2, dtype=torch.int64, device=dev))  # [2] damaged and staged slices (none)
        self.counts = torch.zeros(r, dtype=torch.int64, device=dev)  # [R]
        self.live = torch.zeros(r, dtype=torch.int64, device=dev)  # [R]
        self.tail_slots = torch.full((self.num_layers, r), self.scratch_slot, dtype=torch.int64, device=dev)  # [L, R]
        self.kernel_tokens = torch.zeros(r, dtype=torch.int32, device=dev)  # [R]
        self.addresses = torch.zeros((7, self.num_layers, r), dtype=torch.int64, device=dev)  # [7, L, R]
        self.staging_rows = torch.full((r,), -1, dtype=torch.int64, device=dev)  # [R]
        self.scores = torch.empty((r, h, width), dtype=torch.float32, device=dev)  # [R, H, W]
        # [L][R] per kind: what each row's launches read (the kernels' checks, the CPU references); holding the
        # tensors also keeps a departed table's memory from being reused while a queued token may write it
        self.tables: list[list[list[torch.Tensor]]] = [[[x] * r for _ in range(self.num_layers)] for x in self.scratch]
        self.members: list[DecodeStep | None] = [None] * r
        self._pointers: list[list[int]] = [[] for _ in range(r)]  # a member's summaries addresses when it joined
        self._reallocations = self.tensors.reallocations
        self.staging_pool = t.cold.staging_pool()  # the GPU pool of the cpu tier's format, its staging rows
        self.lanes: list[int | None] = [None] * (self.staging_pool.staging_blocks // t.k)  # lane -> its row
        # whether a member can stage cpu blocks at all: a lane, and per-head sums where the step verifies them
        self.can_stage = bool(self.lanes) and self.tiers.cpu.sum_device == normal_device(dev)
        for row in range(r):
            self._write_row(row, None)

    def __len__(self) -> int:
        return sum(m is not None for m in self.members)

    @property
    def seqs(self) -> tuple[int, ...]:
        """The members' sequences, by row."""
        return tuple(m.seq for m in self.members if m is not None)

    def row_of(self, seq: int) -> int:
        for row, m in enumerate(self.members):
            if m is not None and m.seq == seq:
                return row
        raise KeyError(f"sequence {seq} is in no row of this batch")

    # -- membership, between tokens ------------------------------------------------------------
    def refusal(self, step: DecodeStep) -> str | None:
        """Why `step` cannot take a free row (None: it can): it needs the batch's k and windows, the topk phase
        from its next token on, and tables of at most W blocks."""
        if step.mode != "topk" or step.policy is not None or step.k != self.k or \
                step.recent_tokens != self.window["recent_tokens"]:
            return f"mode {step.mode!r} with k {step.k}: the batch runs Quest's topk with k {self.k}"
        if step.seq in self.seqs:
            return "it is a member already"
        if not serves_next_token(step.tables, self.k, self.block_tokens):
            return "its next token is in the dense phase, or it has blocks beyond the cpu tier or dropped ones"
        if any(t.summaries.shape[0] > self.width for t in step.tables):
            return f"its tables are wider than {self.width} blocks"
        return "a full batch" if None not in self.members else None

    def join(self, step: DecodeStep) -> int:
        """Put `step`'s sequence in the lowest free row (its device state moves into the row); returns the row."""
        refusal = self.refusal(step)
        if refusal is not None:
            raise ValueError(f"SlotBatch: sequence {step.seq} cannot join: {refusal}")
        row = self.members.index(None)
        step.bind_state(self.counts[row: row + 1], self.tail_slots[:, row], self.kernel_tokens[row: row + 1])
        self.members[row] = step
        self._write_row(row, step)
        self._give_lane(row, self.lanes.index(None) if None in self.lanes else None)
        self._pointers[row] = [t.summaries.data_ptr() for t in step.tables]
        return row

    def leave(self, seq: int) -> DecodeStep:
        """Empty `seq`'s row; returns its DecodeStep, holding its device state in tensors of its own again."""
        row = self.row_of(seq)
        step, dev = self.members[row], self.device
        step.bind_state(torch.zeros(1, dtype=torch.int64, device=dev),
                        torch.zeros(self.num_layers, dtype=torch.int64, device=dev),
                        torch.zeros(1, dtype=torch.int32, device=dev))
        step.cold.row_offset = 0  # alone again: the first staging rows
        self.members[row] = None
        self.staging_rows[row: row + 1].fill_(-1)
        if row in self.lanes:  # its staging rows go to a member without any, if there is one
            lane = self.lanes.index(row)
            self.lanes[lane] = None
            waiting = [r for r, m in enumerate(self.members) if m is not None and r not in self.lanes]
            if waiting:
                self._give_lane(waiting[0], lane)
        self.counts[row: row + 1].zero_()
        self.tail_slots[:, row].fill_(self.scratch_slot)
        self._write_row(row, None)
        return step

    def moved(self) -> list[int]:
        """Members whose tables were given new tensors since they joined (another step reserved more capacity):
        their rows address the old ones, so they must leave (and may join again)."""
        if self.tensors.reallocations == self._reallocations:
            return []
        moved = [m.seq for row, m in enumerate(self.members) if m is not None and
                 [t.summaries.data_ptr() for t in m.tables] != self._pointers[row]]
        if not moved:  # asked again until they have left
            self._reallocations = self.tensors.reallocations
        return moved

    def _write_row(self, row: int, step: DecodeStep | None) -> None:
        """A row's addresses (a member's tables and cpu slice counters, or the scratch ones: None) and whether
        it is live."""
        per_layer = [self.scratch] * self.num_layers if step is None else \
            [(t.summaries, t.slot_map, t.tier_map, t.h2o_scores, step.cold.reads[layer], step.cold.counts)
             for layer, t in enumerate(step.tables)]
        for kind, lists in enumerate(self.tables):
            for layer, tensors in enumerate(per_layer):
                lists[layer][row] = tensors[kind]
        values = [tensors[kind].data_ptr() for kind in range(4) for tensors in per_layer]
        values += [tensors[3].stride(0) for tensors in per_layer]
        values += [tensors[kind].data_ptr() for kind in (4, 5) for tensors in per_layer]
        self.addresses[:, :, row].copy_(device_ints(values, self.device).view(7, self.num_layers))
        self.live[row: row + 1].fill_(0 if step is None else 1)

    def _give_lane(self, row: int, lane: int | None) -> None:
        """Row `row`'s member stages into lane `lane`'s k staging rows (None: no lane left; a member holding cpu
        blocks is then not ready, StepColdBlocks.servable, until one frees)."""
        step = self.members[row]
        step.cold.row_offset = (len(self.lanes) if lane is None else lane) * self.k
        if lane is not None:
            self.lanes[lane] = row
        first = -1 if lane is None else self.staging_pool.slots.num_slots + step.cold.row_offset
        self.staging_rows[row: row + 1].fill_(first)

    # -- host side of a token ------------------------------------------------------------------
    def ready(self) -> bool:
        """Whether every member's next token runs from device state (batch.steps_ready), no member's tables
        moved, and there is a member."""
        steps = [m for m in self.members if m is not None]
        return bool(steps) and not self.moved() and steps_ready(steps)

    def begin_token(self) -> tuple[str, ...]:
        """Every member's host work before the token (batch.begin_steps); StepNotReady changes nothing."""
        steps = [m for m in self.members if m is not None]
        if not steps or self.moved():
            raise StepNotReady("SlotBatch: no member, or a member's tables moved; decode this token sequence by "
                               "sequence")
        return begin_steps(steps)  # StepNotReady unless every member's token runs from device state

    def graph_key(self) -> tuple:
        """What a captured token depends on beyond the rows' device state: R, W and the cpu tier's slab
        generation (module docstring), in that order, so GraphedSteps drops a graph over older per-head sums.
        Members, and whether they hold cpu blocks, are device state."""
        return self.num_rows, self.width, self.tiers.cpu.generation if self.can_stage else 0

    def end_token(self) -> None:
        """Every member's host work after the token (at a block boundary a member verifies its cpu slices
        first: IntegrityError as `verify` raises it, once every member's work is done), then what the next
        token cools, for all of them at once (readiness.cool_ahead)."""
        self._each_member(lambda m: m.end_token(cool=False))
        cool_ahead([m.readiness for m in self.members if m is not None])

    def verify(self) -> None:
        """IntegrityError naming each member (sequence and row) for which a cpu slice staged since the last call
        failed its checksum; every member is verified (one host sync each that staged)."""
        self._each_member(DecodeStep.verify)

    def _each_member(self, action: Callable[[DecodeStep], None]) -> None:
        damaged = []
        for row, m in enumerate(self.members):
            if m is None:
                continue
            try:
                action(m)
            except IntegrityError as error:
                damaged.append(f"sequence {m.seq} (row {row}): {error}")
        if damaged:
            raise IntegrityError("SlotBatch: " + "; ".join(damaged))

    # -- device side, capturable ---------------------------------------------------------------
    def token_positions(self) -> torch.Tensor:
        """int64 [R]: each row's position for this token (an empty row's: 0)."""
        return self.counts

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [R, Hq, D], k, v [R, H, D] fp16 of every row's token at `layer` -> out [R, Hq, D] fp16 (a member's
        row: what its DecodeStep.attend returns alone; an empty row's: nothing read). Layers run in order."""
        b, kk = self.block_tokens, self.k
        if layer == 0:  # a live row reads k - 1 full blocks and its tail (DecodeStep.count_tokens); an empty one 0
            self.kernel_tokens.copy_((self.counts % b + ((kk - 1) * b + 1)) * self.live)
        addr, pool = self.addresses[:, layer], self.tiers.hot.pool
        summaries, slot_maps, tier_maps, h2o = (kind[layer] for kind in self.tables[:4])
        if self.cuda:
            append_tokens(pool, summaries, addr[0], k, v, self.tail_slots[layer], self.counts)
            scores = quest_scores_rows(q, summaries, addr[0], self.counts, self.width, out=self.scores, **self.window)
            selected, slots, is_int8 = topk_table_rows(scores, kk, addr[1], addr[2], self.scratch[1:3], WARM_TIER)
        else:
            append_tokens_ref(pool, summaries, k, v, self.tail_slots[layer], self.counts)
            scores = quest_scores_rows_ref(q, summaries, self.counts, self.width, **self.window)
            selected, slots, is_int8 = topk_table_rows_ref(scores, kk, slot_maps, tier_maps, WARM_TIER)
        if self.can_stage and self.tiers.cpu.slabs:  # every row's selected cpu blocks into its lane, one launch
            cpu = self.tiers.cpu
            stage_cold_slices_rows(selected, tier_maps, slot_maps, slots, is_int8, cpu.slab_table(self.device),
                                   cpu.head_sums, fields(self.staging_pool.pool), self.staging_rows, CPU_TIER,
                                   self.tables[5][layer], self.tables[4][layer], (addr[2], addr[1], addr[6], addr[5]))
        warm = self.tiers.warm.pool
        out, mass = self.path.kernel(q, pool, warm.data, warm.k_scale, warm.v_scale, slots, is_int8,
                                     self.kernel_tokens, return_block_mass=True)
        if self.cuda:
            add_mass_rows(mass, selected, addr[3], self.scratch[3], addr[4])
        else:
            add_mass_rows_ref(mass, selected, h2o)
        if layer == self.num_layers - 1:
            self.counts += self.live
        return out
