"""DecodeStep: one sequence's decode step for every layer, built once, replayable as a CUDA graph.

Block tables grow and move, so here, as in vLLM and SGLang, every tensor the step touches is preallocated to a
capacity and addressed through device-side state: one capture stays valid while the sequence grows, and
store.append + store.attend run the same step eagerly (eager_step.py):

    num_tokens   int64 [1]   tokens held before this token (advanced inside the step)
    tail_slot    int64 [L]   hot-pool slot of each layer's tail block
per layer, inside the step (no host sync):
    1. append    k, v of the new token -> the tail block at offset num_tokens % B; widen its summary
                 (dense and topk: inside the attention launch of step 3, kvstore/attention/append.py; the
                 sketch, whose first level reads the tail's summary, appends first)
    2. select    dense: the table itself, viewed up to a bucket of blocks (ceil(n / B) rounded up by at most
                 1.25x, so a short sequence in a long capacity gets a short table's kernel; one graph per bucket);
                 topk (Quest's min/max bound), sketch, cascade or window: k blocks per kv head, ascending;
                 h2o: each layer's live blocks, which the host drops between tokens (step_h2o.py)
    3. attend    the paged kernel over that block table, token count computed on the device; a dense phase
                 with no warm block in any layer passes no warm pool, so a long table takes the hot-only
                 walk (host-known; a graph per case); with warm blocks, a long table's partition by pool
                 is made at begin_token when the tables changed, not in every token (dense_tables.py)
    4. account   the kernel's block mass into the table's H2O scores (added by the kernel's merge); sketch:
                 the certified omitted mass per q head from the merge's log-sum-exp (one launch)
A batch of sequences runs 1-2 and 4 per sequence around one launch of 3 (batch.py, batch_rows.py). Host work
happens only between tokens (begin_token / end_token), at block boundaries: the filled tail's sketch codes,
promotion of cpu blocks the step keeps reading (promotion.py), cooling ahead of the next token (readiness.py,
which also says whether a token can run from device state at all: callers use the DecodePath, eager.py, for a
token it refuses) and a new tail block per layer. Selected cpu blocks are staged inside the step and verified on
the device (cold_slices.py). docs/decode.md, The captured step, tells the whole story.
"""

from __future__ import annotations

import torch

from eviction import Policy
from eviction.certify import omitted_mass_bounds
from eviction.sketch_topk import SketchTopK
from kvstore.attention.append import NewToken, append_token, append_token_ref
from kvstore.blocks.table import DROPPED, LayerTable
from kvstore.blocks.tierset import HOT_TIER, WARM_TIER
from kvstore.decode.cold_slices import StepColdBlocks
from kvstore.decode.dense_tables import StepPartitions, dense_bucket
from kvstore.decode.promotion import StepPromotion
from kvstore.decode.readiness import StepReadiness, cool_ahead
from kvstore.decode.step_h2o import StepEviction
from kvstore.decode.step_parts import Selection, StepParts, encode_filled_tails, open_tail_entries, place_tails, \
    topk_blocks
from kvstore.decode.step_select import StepSelect
from tiers.base import device_ints

STEP_MODES = ("dense", "topk", "sketch", "cascade", "window", "h2o")
assert (HOT_TIER, WARM_TIER) == (0, 1), "the dense step passes tier codes as the kernel's int8 flags"


class StepNotReady(ValueError):
    """This token cannot run from device state (blocks the step cannot reach, capacity reached, GPU pools full):
    nothing of it has happened; run it through store.append + store.attend."""


class DecodeStep:
    def __init__(self, parts: StepParts, seq: int, tables: list[LayerTable], mode: str = "topk",
                 budget: int = 4096, policy: Policy | None = None, capacity_tokens: int | None = None) -> None:
        """`tables`: the sequence's block table of every layer; `policy`: the SketchTopK, CascadeTopK or H2O of
        mode "sketch", "cascade" or "h2o"."""
        if mode not in STEP_MODES:
            raise ValueError(f"DecodeStep mode must be one of {STEP_MODES}, got {mode!r}")
        c = self.config = parts.config
        spec, dev = self.spec, self.device = c.model, parts.device
        self.tiers, self.tensors, self.path = parts.tiers, parts.tensors, parts.path
        self.seq, self.mode, self.budget = seq, mode, budget
        self.policy = policy if mode in ("sketch", "cascade", "h2o") else None  # topk scores with Quest alone
        self.tables = tables
        if mode != "h2o" and any(DROPPED in t.block_ids for t in self.tables):
            raise ValueError("this sequence has blocks H2O dropped: only mode h2o can attend it")
        self.block_tokens = b = c.block_tokens
        length = self.tables[0].num_tokens
        capacity_tokens = capacity_tokens or length + max(16384, length // 16)  # selection scans all of it
        self.capacity = -(-capacity_tokens // b)  # blocks every table is preallocated for
        for t in self.tables:
            self.tensors.reserve(t, self.capacity, exact=True)  # fixed addresses from here on: what a graph needs
        self.table_addresses = tuple(  # int64 [L] each: summaries, H2O scores, H2O row strides (open_tails)
            device_ints(v, dev) for v in ([t.summaries.data_ptr() for t in tables],
                                          [t.h2o_scores.data_ptr() for t in tables],
                                          [t.h2o_scores.stride(0) for t in tables]))
        self.sink_blocks = -(-c.sink_tokens // b)
        self.recent_tokens = self.path.recent_window(budget)
        self.k = topk_blocks(budget, b, self.sink_blocks, self.recent_tokens)  # blocks per head (topk)
        h = spec.num_kv_heads
        self.num_tokens = torch.tensor([length], dtype=torch.int64, device=dev)  # [1]
        self.tail_slot = torch.zeros(spec.num_layers, dtype=torch.int64, device=dev)  # [L]
        self.kernel_tokens = torch.zeros(1, dtype=torch.int32, device=dev)  # [1]
        # [L, Hq] this token's bounds per layer and q head (one launch per layer writes its row)
        self.certified = torch.zeros(spec.num_layers, spec.num_q_heads, dtype=torch.float32, device=dev)
        self._lse = torch.zeros((1, spec.num_q_heads), dtype=torch.float32, device=dev)  # the kernel's, per layer
        self.eviction = StepEviction(  # h2o: the live blocks of every layer, dropped by the same rule as eager
            self.policy, tables, self.tiers, self.k, budget,
            dict(block_tokens=b, sink_tokens=c.sink_tokens, recent_tokens=self.recent_tokens), dev) \
            if mode == "h2o" else None
        self.selector = StepSelect(self.policy, self.capacity, self.k, b, self.sink_blocks, self.recent_tokens, h,
                                   dev, positional=mode == "window",
                                   live=None if self.eviction is None else (self.eviction.rows, self.eviction.count))
        self._append_token = append_token if dev.type == "cuda" else append_token_ref  # one launch on the GPU
        self.cold = StepColdBlocks(self.tiers, self.path.stats, dev, spec, self.capacity)  # staging, verifying
        self.readiness = StepReadiness(tables, self.tiers, self.cold, c, self.capacity, self.k, mode)
        self.promotion = StepPromotion(self.cold, c, self.recent_tokens)  # cpu blocks it keeps reading move up
        self.partitions = StepPartitions(spec, self.capacity, b, dev)  # the dense tables by pool (long, mixed)
        self.stages_cold = False  # this token stages cpu blocks (fixed per token: part of the graph's key)
        self.phase = self.readiness.phase(length + 1)
        self.dense_blocks = dense_bucket(length + 1, b, self.capacity)  # the dense table's length (graph key)
        self._next_layer = 0
        self._sync_tail_slots()

    # -- host side, between tokens -----------------------------------------------------------
    @property
    def length(self) -> int:
        return self.tables[0].num_tokens

    def ready(self) -> bool:
        """Whether the next token can run from device state (StepReadiness.ready; h2o: StepEviction.ready)."""
        return self.readiness.ready() and (self.eviction is None or self.eviction.ready())

    def can_spill(self) -> bool:
        """Whether the next token is served whichever of its blocks cool into the cpu tier (StepReadiness)."""
        return self.readiness.can_spill()

    def note_cold(self) -> None:
        """Whether this token stages cpu blocks, once the token's blocks are where they will be read from (the
        tail blocks opened, and what they cooled, this sequence's or another's)."""
        self.stages_cold = any(t.num_cold for t in self.tables)

    def graph_key(self) -> tuple:
        """What a captured graph of this token depends on beyond device state: its phase, whether it stages cpu
        blocks and, if so, the cpu tier's slab table and sums (they move when the tier grows); dense: its bucket
        and whether any block is warm."""
        return (self.phase, self.stages_cold, self.tiers.cpu.generation if self.stages_cold else 0,
                self.dense_blocks if self.phase == "dense" else 0, self.hot_only)

    def verify(self) -> None:
        """IntegrityError if a cpu slice the steps since the last call read failed its checksum (one host sync;
        nothing to read when no step staged cold blocks). Tokens after the damaged read are not to be trusted."""
        self.cold.verify()

    def begin_token(self) -> str:
        """Host work before a token: prepare_token, then open_token. Returns the token's phase, "dense" or
        "topk": a captured graph is valid for one phase (a sequence of at most k blocks attends all of them,
        then topk takes over for good)."""
        self.prepare_token()
        return self.open_token()

    def prepare_token(self, cool: bool = True, checked: bool = False) -> None:
        """The first half of begin_token: StepNotReady unless the token can run from device state, after
        cooling the blocks it pushes out of their windows (as store.append does, so an eager token after a
        refusal finds them cooled; cool=False: the caller cools them, for a batch at once, then calls
        check_cooled; checked: the caller has just asked ready()). Nothing else of the token has happened on a
        refusal."""
        if not checked and not self.ready():
            raise StepNotReady("DecodeStep: the sequence has cold blocks the step cannot serve, reached its "
                               "capacity or the GPU pools are full; use store.append and store.attend for this token")
        if self._synced_length != self.length:  # tokens were appended eagerly since the last step
            self._sync_tail_slots()
        self._next_layer = 0  # a token that failed part way left nothing on the device count: start over
        self.phase = self.readiness.phase(self.length + 1)
        self.dense_blocks = dense_bucket(self.length + 1, self.block_tokens, self.capacity)
        grown = self.cooling() if cool else []
        if grown:  # only a token that cools can leave a block where the step cannot read it
            self.tiers.cool_tables(grown)
            self.check_cooled()

    def cooling(self) -> list[tuple[LayerTable, int, int]]:
        """What this token cools (StepReadiness.cooling): every layer's table growing by one token, or nothing."""
        return self.readiness.cooling()

    def check_cooled(self) -> None:
        """StepNotReady if what this token cooled left a block in a tier the step cannot serve."""
        if not self.readiness.cold_servable(self.length + 1):
            raise StepNotReady("DecodeStep: this token cools a block to a tier the step cannot serve; use "
                               "store.append and store.attend")

    def open_token(self, placed: bool = False) -> str:
        """The second half: at a block boundary, open the next tail block in every layer (the caller checked
        the GPU pools have room: ready()). placed: the caller has added them (new_tails), put them into the
        hot tier and opened their entries already (open_tail_entries), a batch's in one call. Returns the
        token's phase."""
        if self.at_boundary():
            if not placed:
                self.tiers.check_room(len(self.tables))
                place_tails(self.tiers, self.new_tails(), self.spec, self.block_tokens, self.device)
                open_tail_entries([self])  # min/max of no keys (the step widens them), no H2O mass yet
            self._sync_tail_slots()
        if self.eviction is not None:  # h2o: what exceeds the budget dropped, before anything reads the tiers
            self.eviction.update(self.length + 1)
        self.note_cold()
        self.partitions.update(self.tables, self.dense_blocks, self.length + 1, self.phase == "dense" and
                               not self.hot_only)
        return self.phase

    def at_boundary(self) -> bool:
        """Whether the next token opens a new tail block in every layer."""
        return self.length % self.block_tokens == 0

    def new_tails(self) -> list[int]:
        """At a block boundary: a new block id at the end of every layer's table (the tail from now on, so
        never chosen to cool), not yet stored anywhere: place_tails puts them into the hot tier."""
        ids = self.tiers.blocks.new_ids_for([(self.seq, layer, t.num_blocks) for layer, t in enumerate(self.tables)])
        for table, block_id in zip(self.tables, ids):
            table.block_ids.append(block_id)
        return ids

    def end_token(self, num_layers: int | None = None, cool: bool = True) -> None:
        """Host bookkeeping after a token was launched: lengths and stats, then (cool; a batch cools its sequences
        together) what the next token cools, while this one runs on the GPU (readiness.cool_ahead). num_layers: it
        ran in the first num_layers layers only (store.attend's token settled part way: eager_step.py); the others
        keep their length."""
        old, ran = self.length, self.tables[:num_layers]
        whole, filled = len(ran) == len(self.tables), (old + 1) % self.block_tokens == 0
        for table in ran:
            table.num_tokens = old + 1
        if filled:  # the token filled every tail: its codes on their final grid now,
            encode_filled_tails(ran, self.tiers, self.tensors)  # not at the next begin_token (it may go eager)
        certified = self.certified[:len(ran)].mean(1) if self.phase == "topk" and \
            isinstance(self.policy, SketchTopK) else None  # a tensor of its own: the next replay rewrites the buffer
        self.path.stats.count_token(len(ran), old + 1, self._num_selected(old + 1), self.block_tokens, certified)
        self.cold.token_done(self.stages_cold)
        if filled and whole:  # cpu blocks this sequence keeps reading move up (a sync, if any)
            self.promotion.at_boundary(self.tables)
        self._synced_length = old + 1 if whole else old  # the step advanced the device count after its last layer
        if whole and cool:
            cool_ahead([self.readiness])

    def bind_state(self, num_tokens: torch.Tensor, tail_slot: torch.Tensor, kernel_tokens: torch.Tensor) -> None:
        """Keep the device count [1], tail slots [L] and kernel token count [1] in these tensors from now on
        (views of a batch's row: kvstore/decode/batch_slots.py), holding the current values. Between tokens."""
        for mine, theirs in ((self.num_tokens, num_tokens), (self.tail_slot, tail_slot),
                             (self.kernel_tokens, kernel_tokens)):
            theirs.copy_(mine)
        self.num_tokens, self.tail_slot, self.kernel_tokens = num_tokens, tail_slot, kernel_tokens

    @property
    def hot_only(self) -> bool:
        """Whether this token's kernel goes without the warm pool (part of the graph's key): a dense phase whose
        blocks are all hot (a long table then takes the hot-only walk, not the partition walk that mixed pools
        need; new tail blocks are hot, so the answer changes only when a block cools, at begin_token)."""
        return self.phase == "dense" and not any(t.num_warm for t in self.tables)

    def _num_selected(self, num_tokens: int) -> int:
        if self.eviction is not None:
            return self.eviction.num_live
        return -(-num_tokens // self.block_tokens) if self.readiness.phase(num_tokens) == "dense" else self.k

    def _sync_tail_slots(self) -> None:
        hot = self.tiers.hot
        slots = [hot.slots.slot_of[t.block_ids[-1]] if t.block_ids else 0 for t in self.tables]
        self.tail_slot.copy_(device_ints(slots, self.tail_slot.device))  # queued: tokens may still be running
        self.num_tokens.fill_(self.length)
        self._synced_length = self.length

    # -- device side, capturable -------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append k, v [kv_heads, head_dim] of the new token to `layer`, then attend q [num_q_heads, head_dim]
        over the layer's blocks (the new token included); returns [num_q_heads, head_dim] fp16. The same
        select / attend / account as a batch of sequences (kvstore/decode/batch.py), with the append, the
        H2O accounting and the dense partition inside the one kernel launch."""
        picked = self.select(layer, q, k, v, append_in_kernel=True)
        table = self.tables[layer]
        out, _ = self.path.kernel(q[None], *self.pools(), picked.slots[None], picked.is_int8[None],
                                  self.kernel_tokens, add_mass_to=(table.h2o_scores, picked.selected),
                                  lse_out=self._lse if picked.upper is not None else None, append=picked.append,
                                  partition=self.partitions.of_layer(layer))
        self.account(layer, picked, None, self._lse[0])
        return out[0]

    def pools(self) -> tuple[torch.Tensor, ...]:
        """The kernel's pools: hot, then the warm pool's data, k and v scales (none of it while no block of
        the phase is warm: blocks cool into int8 between tokens, and the graph key says which)."""
        tiers = self.tiers
        warm = tiers.warm.pool.index(slice(0, 0)) if self.hot_only else tiers.warm.pool
        return tiers.hot.pool, warm.data, warm.k_scale, warm.v_scale

    def select(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               append_in_kernel: bool = False) -> Selection:
        """A layer's first half of the token: append k, v (or, append_in_kernel, hand them to the attention
        launch), select the blocks to read and stage the selected cpu ones. Layers run in order."""
        if layer != self._next_layer:  # layer 0 computes the token's counts that every later layer reads
            raise ValueError(f"DecodeStep.attend: a token runs layers 0..{len(self.tables) - 1} in order; "
                             f"expected layer {self._next_layer}, got {layer}")
        self._next_layer = (layer + 1) % len(self.tables)
        table = self.tables[layer]
        if layer == 0:  # what depends only on the token count, once per token for every layer
            self.count_tokens()
        # the sketch's first level reads the tail's summary, which must hold the token first (Quest scores the
        # tail +inf, whatever its summary holds): it never appends inside the attention launch
        tail, new = self.tail_slot[layer: layer + 1], None
        if append_in_kernel and not (isinstance(self.policy, SketchTopK) and self.phase == "topk"):
            new = NewToken(k, v, table.summaries, tail, self.num_tokens)
        else:
            self._append_token(self.tiers.hot.pool, table.summaries, k, v, tail, self.num_tokens)
        selected, slots, is_int8, upper = self.selector(layer, table, q, self.phase, self.dense_blocks, self.num_tokens)
        if self.stages_cold:  # selected cpu blocks: one head's slice each into the staging rows, verified
            self.cold.stage(layer, table, selected, slots, is_int8)
        return Selection(selected, slots, is_int8, upper, new)

    def expect_layer(self, layer: int) -> None:
        """The next select is of `layer` (mod L): a layer replayed from a graph ran no select of its own, one
        recorded into a graph passes through its select a second time (kvstore/decode/layer_graphs.py)."""
        self._next_layer = layer % len(self.tables)

    def account(self, layer: int, picked: Selection, mass: torch.Tensor | None, lse: torch.Tensor) -> None:
        """A layer's second half: the kernel's block mass [H, k] into the table's H2O scores (None: the kernel
        added it), the sketch's certified omitted mass from the log-sum-exp [Hq]; after the last layer the
        device count moves on."""
        if mass is not None:
            self.tables[layer].h2o_scores.scatter_add_(1, picked.selected, mass)
        if picked.upper is not None:  # the sketch's certified omitted mass, kept on the device (end_token counts it)
            omitted_mass_bounds(picked.upper, picked.selected, lse, out=self.certified[layer])
        self.advance(layer)

    def advance(self, layer: int) -> None:
        """After the token's last layer, the device count moves on."""
        if layer == len(self.tables) - 1:
            self.num_tokens += 1

    def count_tokens(self) -> None:
        """This token's counts from the device's num_tokens (StepSelect.count), once per token."""
        self.selector.count(self.num_tokens, self.phase, self.kernel_tokens)
