"""EagerSteps: store.append + store.attend of a decode token run through the DecodeStep's code, eagerly.

An engine that decodes without a capture (transformers through KVTierCache, Decoder(graphs=False), its own loop)
calls per layer, layers in order, store.append(seq, layer, k, v) with one token and store.attend(seq, layer, q,
mode, budget). Such a token runs through the sequence's DecodeStep of (mode, budget) (step.py; built on first use,
again when its capacity is reached or its tables' tensors moved): the captured step's append, select, stage, attend
and account without a host sync (on CUDA each layer's as one graph replay: layer_graphs.py, Config.eager_graphs),
so outputs and stored bytes are the step's, bit for bit.

    store.append(seq, 0, k, v)      one token: k, v kept (a copy); only the room for a new block is checked
    store.attend(seq, 0, q, ...)    the step's begin_token (host work: new tail blocks at a boundary), then
                                    its attend of layer 0, which appends k, v inside the attention launch
    layers 1 .. L-1                 the same append + attend; the last layer's attend ends the token (end_token:
                                    it cools what the next token pushes out of its windows)
A token the step cannot serve runs through the DecodePath (eager.py), layer by layer, and stats()["attend"] counts
it in fallback_calls by reason (step_calls: the calls the step served):
    mode          policy instances with settings the step does not implement (step_mode: TopK(group_reduce="sum"),
                  a CascadeTopK with a basis, others' own policies)
    epsilon, measure_mass
    not_ready     blocks beyond the cpu tier, capacity or GPU pools (StepNotReady), H2O-dropped blocks outside mode
                  h2o, h2o's first token over all-zero scores (the DecodePath seeds them), layers of unequal length
    unpaired      an attend that no one-token append of layer 0 began: an attend without an append, layers out of
                  order, a layer attended twice, a mode or budget changed inside the token, the sequence's blocks
                  moved by another sequence's work part way through the token
Whatever else touches the sequence first settles it (KVStore does, before reads, saves, forks, stats, integrity
checks ...): kept K/V are appended the eager way (AppendPath), so a layer appended and never attended is stored;
a token the step began keeps the layers it ran (counted and keyed as end_token does), the tail blocks it opened in
the layers it did not reach are let go, and those layers take their appends and attends the eager way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from eviction import H2O, CascadeTopK, Policy, SketchTopK, TopK, Window
from kvstore.blocks.table import LayerTable
from kvstore.decode.layer_graphs import LayerGraphs
from kvstore.decode.modes import reads_codes, resolve_policy
from kvstore.decode.step import STEP_MODES, DecodeStep, StepNotReady
from kvstore.decode.step_parts import StepParts

Append = Callable[[int, int, torch.Tensor, torch.Tensor], None]  # (seq, layer, k [T, H, D], v): the eager append


@dataclass(slots=True)
class OpenToken:
    """A sequence's decode token between its layer-0 append and its last layer's attend."""
    kv: torch.Tensor | None  # [2, H, D]: k and v of layer `next`, appended, not yet attended
    next: int = 0  # the next layer to attend
    step: DecodeStep | None = None  # the step running the token (None: not begun, or the DecodePath's)
    graphs: LayerGraphs | None = None  # the step's layers as CUDA graphs (None: launched one by one)
    moves: list[int] | None = None  # each table's moves when the step began
    reason: str | None = None  # why the DecodePath runs this token, for each of its layers
    key: str | None = None  # mode_key of the mode the token began with


class EagerSteps:
    def __init__(self, parts: StepParts, sequences: dict[int, list[LayerTable]], policies: dict[str, Policy],
                 load_codes: Callable[[int], None], append: Append, key_blocks: Callable[[int, int], None]) -> None:
        """parts: what steps are built from; sequences: the store's tables; policies: mode -> the store's policy;
        load_codes(seq): an opened sequence's sketch codes read; append: the eager append (the AppendPath, then
        content keys); key_blocks(seq, layer): the content keys of a layer's full blocks."""
        self.parts, self.sequences, self.policies = parts, sequences, policies
        self.load_codes, self.append, self.key_blocks = load_codes, append, key_blocks
        self.stats, self.block_tokens = parts.path.stats, parts.config.block_tokens
        # (seq, mode_key, budget) -> (step, table addresses, its layers' graphs or None: Config.eager_graphs)
        self.steps: dict[tuple[int, str, int], tuple[DecodeStep, tuple[int, ...], LayerGraphs | None]] = {}
        self.tokens: dict[int, OpenToken] = {}

    def build(self, seq: int, mode: str | Policy, budget: int, capacity_tokens: int | None = None) -> DecodeStep:
        """A DecodeStep for `seq` (KVStore.decode_step) of a mode or a policy instance the step implements
        (step_mode); ValueError for one it or the store cannot serve."""
        resolve_policy(mode, self.policies, self.parts.config.sketch_codes)
        name = step_mode(mode)
        if name is None:
            raise ValueError(f"the decode step serves modes {STEP_MODES} and policy instances of their settings, "
                             f"got {mode!r}")
        if reads_codes(mode):
            self.load_codes(seq)  # an opened sequence reads its sketch codes now
        policy = self.policies.get(mode) if isinstance(mode, str) else mode
        return DecodeStep(self.parts, seq, self.sequences[seq], name, budget, policy, capacity_tokens)

    # -- store.append and store.attend --------------------------------------------------------
    def hold(self, seq: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> bool:
        """store.append's first stop, its arguments checked: True when k, v [1, H, D] are kept for the layer's
        attend; False when they are to be appended the eager way now (the sequence settled)."""
        token = self.tokens.get(seq)
        one = k.shape[0] == 1
        if one and token is not None and token.step is not None and token.kv is None and layer == token.next:
            # straight into the step's graph inputs where it has them: one copy, not a stack and a copy
            token.kv = torch.stack((k[0], v[0]), out=None if token.graphs is None else token.graphs.kv)
            return True
        self.settle(seq)
        if not one:  # a prefill chunk: no decode token
            self.tokens.pop(seq, None)
        if not one or layer != 0:
            return False
        if self.sequences[seq][0].num_tokens % self.block_tokens == 0:  # CapacityError, nothing kept, where the
            self.parts.tiers.check_room(1)  # AppendPath would raise it
        self.tokens[seq] = OpenToken(torch.stack((k[0], v[0])))
        return True

    def attend(self, seq: int, layer: int, q: torch.Tensor, mode: str | Policy, budget: int, measure_mass: bool,
               epsilon: float | None) -> torch.Tensor | None:
        """store.attend's first stop, its arguments checked: out [Hq, D] when the step served the layer; None
        when the DecodePath is to serve it (the sequence settled, the call counted by reason)."""
        token = self.tokens.get(seq)
        why = refusal(mode, measure_mass, epsilon)
        if why is None and token is not None and token.kv is not None and layer == token.next:
            if token.step is None:  # layer 0: the token begins
                why = self._begin(seq, token, mode, budget)
            elif (token.key, token.step.budget) != (mode_key(mode), budget) or \
                    token.step.tables[layer].moves != token.moves[layer]:
                why = "unpaired"
            if why is None:
                return self._run(seq, token, layer, q)
        self.settle(seq)
        if why == "not_ready":  # the token's later layers count the same
            self.tokens[seq] = OpenToken(None, reason=why)
        why = why or (token.reason if token is not None and token.reason else "unpaired")
        self.stats.fallback_calls[why] = self.stats.fallback_calls.get(why, 0) + 1
        return None

    def _begin(self, seq: int, token: OpenToken, mode: str | Policy, budget: int) -> str | None:
        """Begin the token on the step of (seq, mode, budget); None, or why it cannot ("not_ready")."""
        tables = self.sequences[seq]
        if any((t.num_dropped and step_mode(mode) != "h2o") or t.num_tokens != tables[0].num_tokens for t in tables):
            return "not_ready"
        step, graphs = self._step(seq, mode, budget, tables)
        try:
            step.begin_token()
        except StepNotReady:  # nothing of the token happened (what it cooled stays cooled, as an append would)
            return "not_ready"
        token.step, token.graphs, token.moves, token.key = step, graphs, [t.moves for t in tables], mode_key(mode)
        return None

    def _step(self, seq: int, mode: str | Policy, budget: int,
              tables: list[LayerTable]) -> tuple[DecodeStep, LayerGraphs | None]:
        """The kept step of (seq, mode, budget), or a new one when it reached its capacity or a table's tensors
        moved (another step grew them). A new step takes the room the tables have, so that building it moves no
        table under another step (a captured graph reads them where they are), or the default once that is full."""
        key = (seq, mode_key(mode), budget)
        step, addresses, graphs = self.steps.get(key, (None, (), None))
        if step is not None and addresses == _addresses(tables) and \
                step.length + 1 <= step.capacity * self.block_tokens:
            return step, graphs
        room = min(0 if t.summaries is None else t.summaries.shape[0] for t in tables) * self.block_tokens
        step = self.build(seq, mode, budget, room if room > tables[0].num_tokens else None)
        graphs = LayerGraphs(step) if self.parts.config.eager_graphs else None
        self.steps[key] = (step, _addresses(tables), graphs)
        return step, graphs

    def _run(self, seq: int, token: OpenToken, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The step's append + select + stage + attend + account of one layer; the last layer ends the token."""
        step, graphs = token.step, token.graphs
        out = step.attend(layer, q, token.kv[0], token.kv[1]) if graphs is None else graphs.attend(layer, q, token.kv)
        token.kv, token.next = None, token.next + 1
        self.stats.step_calls += 1
        if token.next == len(step.tables):
            del self.tokens[seq]
            self._end(seq, step)
            step.verify()  # IntegrityError if a cpu slice it read was damaged (a sync only when it read one)
        return out

    def _end(self, seq: int, step: DecodeStep, num_layers: int | None = None) -> None:
        step.end_token(num_layers)
        for layer in range(len(step.tables) if num_layers is None else num_layers):
            self.key_blocks(seq, layer)

    # -- between calls --------------------------------------------------------------------------
    def settle(self, seq: int) -> None:
        """Finish what a decode token of `seq` left open (module docstring)."""
        token = self.tokens.get(seq)
        if token is None or (token.kv is None and token.step is None):
            return
        del self.tokens[seq]
        step = token.step
        if step is not None:
            tables, opened = step.tables, step.at_boundary()
            self._end(seq, step, token.next)
            for layer in range(token.next, len(tables)) if opened else ():  # the tails it opened, not reached
                self.parts.tiers.release(seq, layer, [tables[layer].num_blocks - 1])
                tables[layer].block_ids.pop()
        if token.kv is not None:
            self.append(seq, token.next, token.kv[0:1], token.kv[1:2])
        if step is not None:
            step.verify()

    def settle_all(self) -> None:
        for seq in list(self.tokens):
            self.settle(seq)

    def forget(self, seq: int) -> None:
        """`seq` is freed: its token and steps go, nothing of them stored."""
        self.tokens.pop(seq, None)
        for key in [key for key in self.steps if key[0] == seq]:
            del self.steps[key]


def step_mode(mode: str | Policy) -> str | None:
    """The step mode serving `mode`: a mode name, or a policy instance whose settings the step implements (TopK
    bounding every q head, Window, H2O, SketchTopK, CascadeTopK on raw channels); None: the DecodePath's."""
    if isinstance(mode, str):
        return mode if mode in STEP_MODES else None
    if type(mode) is TopK:
        return "topk" if mode.group_reduce == "max" else None
    if type(mode) is Window:
        return "window"
    if type(mode) is SketchTopK:
        return "sketch"
    if type(mode) is CascadeTopK:
        return "cascade" if mode.basis is None else None
    if type(mode) is H2O:
        return "h2o"
    return None


def mode_key(mode: str | Policy) -> str:
    """What tells modes apart for the kept steps: the name, or an instance's settings (its repr)."""
    return mode if isinstance(mode, str) else repr(mode)


def refusal(mode: str | Policy, measure_mass: bool, epsilon: float | None) -> str | None:
    """Why the step cannot serve a store.attend with these arguments, or None."""
    if step_mode(mode) is None:
        return "mode"
    return "epsilon" if epsilon is not None else "measure_mass" if measure_mass else None


def _addresses(tables: list[LayerTable]) -> tuple[int, ...]:
    return tuple(0 if t.summaries is None else t.summaries.data_ptr() for t in tables)
