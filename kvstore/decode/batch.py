"""BatchStep: one decode token of B sequences, each layer one attention launch over all of them.

Each sequence keeps its own DecodeStep (kvstore/decode/step.py): its device count, tail slots, phase,
selection and cold staging. Per layer the batch runs every sequence's first half (append, select, stage:
DecodeStep.select), then one paged-kernel launch over the B block tables stacked [B, H, k] with each row's
token count, then every sequence's second half (H2O mass, the sketch's certificate, the count:
DecodeStep.account). The model's matmuls around it run once for the B tokens, which is where a batch
gains: a decode step's weight read is shared by every sequence in it.

A batch of one is the single-sequence step itself (DecodeStep.attend: append, mass and partition inside the
one launch). A row attends exactly what that sequence would attend alone; only the launch plan (the split
count the kernel picks for the batch size) may reorder a row's floating-point sums.

Cold blocks: each sequence stages its selected cpu slices into staging rows of its own (row_offset), so the
pool of the cpu tier's format needs batch x k staging rows. Everything is addressed through device state as
in the single step, so a batch replays as one CUDA graph per membership and graph key (kvstore/decode/graphs.py).
"""

from __future__ import annotations

import torch

from kvstore.decode.batch_rows import BatchRows
from kvstore.decode.readiness import cool_ahead
from kvstore.decode.step import DecodeStep, StepNotReady
from kvstore.decode.step_parts import Selection, open_tail_entries, place_tails


class BatchStep:
    def __init__(self, steps: list[DecodeStep]) -> None:
        if not steps:
            raise ValueError("BatchStep needs at least one sequence")
        first = steps[0]
        if len({s.seq for s in steps}) != len(steps):
            raise ValueError(f"BatchStep: a sequence appears twice in {[s.seq for s in steps]}")
        if any((s.mode, s.budget, s.tiers) != (first.mode, first.budget, first.tiers) for s in steps):
            raise ValueError("BatchStep: every sequence must run the same mode and budget on one store")
        self.steps, self.device, self.tiers = steps, first.device, first.tiers
        self.seqs = tuple(s.seq for s in steps)
        offset = 0
        for s in steps:  # staging rows of its own for each sequence's selected cpu slices
            s.cold.row_offset, offset = offset, offset + s.k
        b, dev = len(steps), self.device
        self.positions = torch.zeros(b, dtype=torch.int64, device=dev)  # [B] each sequence's next position
        self.kernel_tokens = torch.zeros(b, dtype=torch.int32, device=dev)  # [B]
        self.lse = torch.zeros((b, first.spec.num_q_heads), dtype=torch.float32, device=dev)  # [B, Hq]
        self.rows = BatchRows(steps) if b > 1 and first.mode == "topk" else None  # one launch per kernel
        self.batched = False  # this token selects through self.rows (host-known: part of the graph key)

    def __len__(self) -> int:
        return len(self.steps)

    # -- host side, between tokens -----------------------------------------------------------
    def ready(self) -> bool:
        """Whether every sequence's next token runs from device state (steps_ready)."""
        return steps_ready(self.steps)

    def begin_token(self) -> tuple[str, ...]:
        """Every sequence's host work before a token (begin_steps); StepNotReady leaves every sequence as it was."""
        phases = begin_steps(self.steps)
        self.batched = self.rows is not None and self.rows.serves()
        return phases

    def end_token(self) -> None:
        for s in self.steps:
            s.end_token(cool=False)
        cool_ahead([s.readiness for s in self.steps])

    def graph_key(self) -> tuple:
        """The membership, then each sequence's phase and staging (a change makes older graphs stale, as in
        GraphedSteps), then the rest of each sequence's key."""
        keys = [s.graph_key() for s in self.steps]
        return (self.seqs, tuple(k[:2] for k in keys), tuple(k[2:] for k in keys), self.batched)

    def verify(self) -> None:
        for s in self.steps:
            s.verify()

    # -- device side, capturable -------------------------------------------------------------
    def token_positions(self) -> torch.Tensor:
        """int64 [B]: each sequence's position for this token (its device count before the token)."""
        if len(self.steps) == 1:
            return self.steps[0].num_tokens
        torch.cat([s.num_tokens for s in self.steps], out=self.positions)
        return self.positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, D], k, v [B, H, D] fp16 of the B sequences' new tokens at `layer` -> out [B, Hq, D] fp16
        (row i: what steps[i].attend returns)."""
        if len(self.steps) == 1:
            return self.steps[0].attend(layer, q[0], k[0], v[0])[None]
        picked = None  # each sequence's Selection, when they select one by one
        if self.batched:  # every sequence in Quest's topk phase: one launch per kernel for all of them
            selected, table, flags = self.rows.select(layer, q, k, v)
        else:
            picked = [s.select(layer, q[i], k[i], v[i]) for i, s in enumerate(self.steps)]
            table, flags = self._stack(picked)
        if layer == 0:  # the token counts every layer's launch reads
            torch.cat([s.kernel_tokens for s in self.steps], out=self.kernel_tokens)
        certify = picked is not None and any(p.upper is not None for p in picked)
        pools = self.steps[0].pools() if all(s.hot_only for s in self.steps) else self._both_pools()
        out, mass = self.steps[0].path.kernel(q, *pools, table, flags, self.kernel_tokens, return_block_mass=True,
                                              lse_out=self.lse if certify else None)
        if picked is None:
            self.rows.account(layer, selected, mass)
        else:
            for i, (s, p) in enumerate(zip(self.steps, picked)):
                s.account(layer, p, mass[i, :, : p.selected.shape[1]], self.lse[i])
        return out

    def _stack(self, picked: list[Selection]) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's block table [B, H, width] and flags of the sequences' selections."""
        widths = [p.selected.shape[1] for p in picked]
        same = len({p.is_int8.dtype for p in picked}) == 1  # bool (topk) or int8 tier codes (dense): 1 is warm
        if len(set(widths)) == 1 and same:  # topk: every sequence selects k blocks
            return torch.stack([p.slots for p in picked]), torch.stack([p.is_int8 for p in picked])
        # dense phases of different lengths: each row's first entries (the kernel reads no further)
        shape = (len(picked), picked[0].slots.shape[0], max(widths))
        table = torch.zeros(shape, dtype=torch.int32, device=self.device)
        flags = torch.zeros(shape, dtype=torch.int8, device=self.device)
        for i, p in enumerate(picked):
            table[i, :, : widths[i]] = p.slots
            flags[i, :, : widths[i]] = p.is_int8
        return table, flags

    def _both_pools(self) -> tuple[torch.Tensor, ...]:
        warm = self.tiers.warm.pool
        return self.tiers.hot.pool, warm.data, warm.k_scale, warm.v_scale


def steps_ready(steps: list[DecodeStep]) -> bool:
    """Whether every sequence's next token runs from device state, with room for the new tail blocks of all
    that reach a block boundary together (as StepReadiness.has_room)."""
    if not all(s.ready() for s in steps):
        return False
    opening = sum(len(s.tables) for s in steps if s.at_boundary())
    tiers = steps[0].tiers
    gpu = tiers.hot.free_blocks() + tiers.warm.free_blocks()
    # cooling to make room may take any sequence's blocks: every one of them must serve its cpu blocks
    return gpu >= opening or (all(s.can_spill() for s in steps) and gpu + tiers.cpu.free_blocks() >= opening)


def begin_steps(steps: list[DecodeStep]) -> tuple[str, ...]:
    """Every sequence's host work before a token (DecodeStep.begin_token), for several decoded together: all of
    them prepared first, so a refusal (StepNotReady) leaves no sequence with its tail blocks opened; decode that
    token sequence by sequence then. Returns each sequence's phase."""
    if not steps_ready(steps):
        raise StepNotReady("BatchStep: a sequence has blocks the step cannot serve, reached its capacity, "
                           "or the GPU pools cannot take the new tail blocks; decode this token sequence "
                           "by sequence")
    tiers, first = steps[0].tiers, steps[0]
    for s in steps:
        s.prepare_token(cool=False, checked=True)  # steps_ready above asked every sequence
    cooling = [s for s in steps if s.cooling()]
    if cooling:  # one move per pair of tiers for the whole batch
        tiers.cool_tables([grown for s in cooling for grown in s.cooling()])
        for s in cooling:
            s.check_cooled()
    opening = [s for s in steps if s.at_boundary()]
    if opening:  # every sequence's new tails in one placement: the room they need is made once
        tiers.check_room(sum(len(s.tables) for s in opening))
        place_tails(tiers, [i for s in opening for i in s.new_tails()], first.spec, first.block_tokens,
                    first.device)
        open_tail_entries(opening)
    phases = tuple(s.open_token(placed=True) for s in steps)
    for s in steps:  # a later sequence's new tails may have cooled an earlier one's blocks into cpu
        s.note_cold()
    return phases
