"""KVStore: the KV cache of many sequences as fixed-size blocks across tiers.

The facade users hold. It owns the sequences' block tables, a TierSet (where every block lives and how it moves),
an AppendPath (fill the tail -> new blocks -> place -> cool), a DecodePath (select -> stage -> attend -> account),
EagerSteps (a decode token's store.append + store.attend through the DecodeStep's code), Contexts (sequences, token
ids, content keys, fork and prefix sharing by reference count), SavedContexts (save / open beside the cold tier: the
ssd tier's LMDB or Redis) and UnreadCodes (the sketch codes opened sequences left in their saves), checks every
argument before anything changes, and hands each part only what it works on.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import torch

from eviction import POLICIES, Policy
from kvstore.blocks.append_path import AppendPath
from kvstore.blocks.from_saved import load_saved
from kvstore.blocks.table import DROPPED, LayerTable, TableTensors, droppable
from kvstore.blocks.tierset import HOT_TIER, TierSet
from kvstore.config import Config, is_int
from kvstore.contexts.background_load import BackgroundLoads
from kvstore.contexts.background_save import BackgroundSaves, SaveJob
from kvstore.contexts.freeing import RELEASE_BATCH
from kvstore.contexts.saving import SavedContexts, values_store
from kvstore.contexts.sequences import Contexts, PrefixMatch, check_token_ids
from kvstore.contexts.unread_codes import UnreadCodes
from kvstore.decode.eager import DecodePath
from kvstore.decode.eager_step import EagerSteps
from kvstore.decode.modes import MODES, check_kv, check_query, reads_codes, resolve_policy
from kvstore.decode.step import DecodeStep
from kvstore.decode.step_parts import StepParts
from tiers.errors import CapacityError
from tiers.layout import BlockLayout


class KVStore:
    def __init__(self, config: Config) -> None:
        c = self.config = config
        self.spec = c.model
        self.device = torch.device(c.device)
        self.layout = BlockLayout.of(c.model, c.block_tokens, c.warm_format, c.int4_group)
        self.sequences: dict[int, list[LayerTable]] = {}
        self.tensors = TableTensors(c.model.num_kv_heads, c.model.head_dim, c.block_tokens, self.device,
                                    c.sketch_codes)
        self.tiers = TierSet(c, self.layout, self.sequences, self.tensors)
        try:
            self._assemble(c)
        except BaseException:  # nothing of a store that never opened stays (its temporary directory)
            self.tiers.close()
            raise

    def _assemble(self, c: Config) -> None:
        """The parts that work on the tier set."""
        self.decode = DecodePath(c, self.tiers)
        self.appends = AppendPath(c, self.tiers, self.tensors)
        self.unread = UnreadCodes(self.sequences, c.block_tokens, self.device)  # sketch codes left in saves
        self.contexts = Contexts(c, self.sequences, self.tiers, self.tensors, self.unread)
        self.loads = BackgroundLoads(self.tiers)  # opened sequences' blocks read on threads, placed between tokens
        self.saves = BackgroundSaves(self.tiers)  # saves copied out between tokens, written on threads
        values = values_store(self.tiers.cold)  # None: the sidecar's cold tier holds no saved contexts
        self.saved = None if values is None else SavedContexts(values, self.tiers, self.contexts.root, c.model_id)
        if values is not None:
            self.tiers.saved.serve_from(values)
        self.policies: dict[str, Policy] = {name: cls() for name, cls in POLICIES.items()}  # mode -> default policy
        self.steps = EagerSteps(StepParts(c, self.device, self.tiers, self.tensors, self.decode), self.sequences,
                                self.policies, self.unread.load_if_needed, self._append_eager, self.contexts.key_blocks)

    # -- sequences ---------------------------------------------------------------------------
    def create_sequence(self, prefix: PrefixMatch | None = None) -> int:
        """A new, empty sequence; or one that starts on a held prefix (`match_prefix`'s answer): its
        blocks shared by reference, its token ids known, nothing copied."""
        if prefix is not None and not isinstance(prefix, PrefixMatch):
            raise ValueError(f"prefix must be a PrefixMatch from match_prefix, got {type(prefix).__name__}")
        return self.contexts.create(prefix)

    def fork(self, seq: int) -> int:
        """A new sequence holding what `seq` holds, without copying K/V: full blocks are shared by reference
        count, the partial tail block (appends write it in place) is copied. Both then grow independently;
        `free` of either leaves the other intact."""
        self.table(seq, 0)
        return self.contexts.fork(seq)

    def extend_tokens(self, seq: int, token_ids: Sequence[int], *, catch_up: bool = False) -> None:
        """Record the token ids at the sequence's next positions (before or with their K/V; ids must cover
        the sequence from position 0). Full blocks of known tokens get content keys, so `match_prefix` can
        find them. engine_adapter.Decoder calls this for every prompt and decoded token. catch_up=True: the
        ids of K/V already appended (a decode that ran ahead of the host), exactly up to the held length."""
        self.table(seq, 0)
        self.contexts.extend(seq, check_token_ids(token_ids), catch_up)

    def tracks_tokens(self, seq: int) -> bool:
        """Whether extend_tokens may be called: the sequence is empty or its ids are known from position 0."""
        self.table(seq, 0)
        return self.contexts.tracks_tokens(seq)

    def token_ids(self, seq: int) -> list[int] | None:
        """The recorded token ids of `seq` (None: its K/V came without ids)."""
        self._table(seq, 0)
        return self.contexts.token_ids(seq)

    # -- saved contexts ----------------------------------------------------------------------
    def save(self, seq: int, name: str, background: bool = False) -> SaveJob | None:
        """Persist `seq` as `name` beside the cold tier (the ssd tier's LMDB at Config.ssd_path, or Redis at
        Config.redis_url, where full blocks of known token ids are stored once under their content keys, so a
        save there needs Config.model_id: ValueError without): every block from whichever tier holds it, key
        summaries, sketch codes, H2O scores and token ids. Returns once durable; an interrupted save leaves
        nothing under `name` (an earlier save of `name` stays until this one commits, then is replaced).
        background=True: returns a SaveJob at once (done(), wait(timeout), progress) that saves `seq` as it is now
        while tokens decode: pump_saves (engine_adapter.Decoder calls it before every token) copies a bounded part a
        call, a thread writes (kvstore/contexts/background_save.py)."""
        if not isinstance(background, bool):
            raise ValueError(f"background must be True or False, got {background!r}")
        self.table(seq, 0)
        codes = partial(self.unread.codes, seq)  # codes an opened sequence never read go save to save
        if background:
            return self.saves.start(self._saved_contexts(), seq, name, self.sequences[seq], self.token_ids(seq), codes)
        self._saved_contexts().save(name, self.sequences[seq], self.token_ids(seq), codes)
        return None

    def open(self, name: str, background_load: bool = False) -> int:
        """A new sequence on the saved context `name` (saved by any process with this ssd_path or redis_url,
        model_id and geometry): summaries, H2O scores, tables and token ids load now, so a top-K decode can
        start at once; sketch codes load when mode="sketch" first needs them; blocks are read from the
        saved values when selected (or promoted). Sinks, the recent window and the tail load now. Outputs
        equal the saved sequence's. background_load: a thread reads the other blocks meanwhile, newest first,
        and place_loaded (engine_adapter.Decoder calls it before every token) puts them where store.load would:
        once all are in, the captured decode step serves the sequence (kvstore/contexts/background_load.py)."""
        if not isinstance(background_load, bool):
            raise ValueError(f"background_load must be True or False, got {background_load!r}")
        seq = self.contexts.start_saved(self._saved_contexts().load(name))
        if background_load:
            self.loads.start(seq, self.sequences[seq])
        return seq

    def load(self, seq: int, max_blocks: int | None = None) -> int:
        """Move up to `max_blocks` (default: all) of an opened sequence's blocks that are still read from its
        save into the tiers their positions belong in (the hot and warm windows on the GPU, the rest in cpu),
        newest first, into free room only (no other block cools for them; what does not fit stays in the
        save). A sequence whose blocks are all on the GPU or in the cpu tier decodes through the captured step
        (open(name, background_load=True) loads on a thread instead). Returns how many blocks moved (0: nothing
        left to load, or no room)."""
        self.table(seq, 0)
        return load_saved(self.tiers, self.sequences[seq], _check_max_blocks(max_blocks))

    def place_loaded(self) -> int:
        """Put the blocks that background loads (open(..., background_load=True)) have read since the last call
        into their tiers: between tokens, a bounded pause. Returns how many moved; raises what a read raised
        (IntegrityError, BlockMissingError), once, and that load ends."""
        return self.loads.place()

    def pump_saves(self) -> int:
        """Copy the next part of the background saves (save(..., background=True)) out of the tiers for their
        writers, or commit one whose data is durable: between tokens, at most saves.pump_blocks blocks, rows of
        summaries and sketch codes counted by their bytes (saves.rows_per_block rows a block). Returns how many
        blocks' worth were copied; never raises for a save (its wait() does)."""
        return self.saves.pump()

    def saved_contexts(self) -> list[str]:
        """Names of the contexts saved at this store's ssd_path (or in its Redis)."""
        return self._saved_contexts().names()

    def delete_saved(self, name: str) -> None:
        """Delete a saved context (stores that have it open can no longer read its blocks)."""
        self._saved_contexts().delete(name)

    def _saved_contexts(self) -> SavedContexts:
        if self.saved is None:
            raise ValueError("saved contexts live beside the local ssd tier (Config.ssd_path) or Redis "
                             f"(Config.redis_url); this store's cold tier is {self.tiers.cold.name}")
        return self.saved

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """The longest prefix of `token_ids`, in whole blocks, whose K/V the store holds in every layer
        (under this store's model_id); `.num_tokens` is 0 when none is. Pass it to create_sequence."""
        self.steps.settle_all()
        return self.contexts.match(check_token_ids(token_ids))

    def table(self, seq: int, layer: int) -> LayerTable:
        table = self._table(seq, layer)  # then what a decode token of seq left open is finished (EagerSteps.settle)
        self.steps.settle(seq)
        return table

    def _table(self, seq: int, layer: int) -> LayerTable:
        if seq not in self.sequences or seq in self.contexts.freeing:
            raise KeyError(f"unknown sequence {seq!r} (never created or already freed)")
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.spec.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.spec.num_layers}), got {layer!r}")
        return self.sequences[seq][layer]

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of num_tokens tokens holds, over all layers."""
        return self.spec.num_layers * -(-num_tokens // self.config.block_tokens)

    def free_blocks(self) -> int:
        """Blocks the GPU pools and the cpu tier can still take: the room a captured step serves from (the
        ssd and saved tiers lie beyond it). A sequence of n tokens fits while blocks_for(n) <= free_blocks()."""
        self.steps.settle_all()
        tiers = self.tiers
        return tiers.hot.free_blocks() + tiers.warm.free_blocks() + tiers.cpu.free_blocks()

    def free(self, seq: int, background: bool = False) -> None:
        """Let go of every block of `seq`: blocks no other sequence shares return to their tiers. background=True:
        `seq` is gone at once (later calls naming it raise KeyError) and its blocks return a bounded batch per
        release_freed (engine_adapter.Decoder calls it before every token), so freeing a long context does not
        stall the others' next token; free_blocks() counts them once returned."""
        if not isinstance(background, bool):
            raise ValueError(f"background must be True or False, got {background!r}")
        self._table(seq, 0)
        self.steps.forget(seq)
        self.loads.stop(seq)
        self.saves.stop(seq)  # a background save still reading seq ends (SaveAborted), leaving nothing
        self.contexts.free(seq, background)

    def release_freed(self, max_blocks: int | None = RELEASE_BATCH) -> int:
        """Return up to `max_blocks` (None: all) table entries of sequences freed with background=True to their
        tiers; returns how many went (0: none left)."""
        return self.contexts.freeing.release(_check_max_blocks(max_blocks))

    def freeing_blocks(self) -> int:
        """Table entries of sequences freed with background=True not yet returned (release_freed)."""
        return self.contexts.freeing.entries()

    def drop(self, seq: int, layer: int, indices: Sequence[int]) -> None:
        """Free blocks for good (H2O drop mode): they are never attended or read again."""
        table = self.table(seq, layer)
        self.tiers.drop(table, droppable(table, indices))

    # -- append ------------------------------------------------------------------------------
    def append(self, seq: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append k, v [T, kv_heads, head_dim] (fp16, finite, on the store's device) to one layer. Raises CapacityError,
        leaving the store unchanged, when the tiers cannot hold them. A decode token (T = 1) may go in with the
        layer's attend (kvstore/decode/eager_step.py: the K/V are stored before any other call sees the sequence)."""
        self._table(seq, layer)
        check_kv(k, v, self.spec, self.device)
        if not self.steps.hold(seq, layer, k, v):
            self._append_eager(seq, layer, k, v)

    def _append_eager(self, seq: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.appends.append(seq, layer, self.sequences[seq][layer], k, v)
        self.contexts.key_blocks(seq, layer)

    # -- read --------------------------------------------------------------------------------
    def read(self, seq: int, layer: int, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K, V [end - start, kv_heads, head_dim] fp16 on the store's device."""
        table = self.table(seq, layer)
        end = table.num_tokens if end is None else end
        if not (is_int(start) and is_int(end) and 0 <= start <= end <= table.num_tokens):
            raise ValueError(f"need 0 <= start <= end <= {table.num_tokens}, got start={start!r} end={end!r}")
        b = self.config.block_tokens
        first, last = start // b, -(-end // b)
        ids = table.block_ids[first:last]
        if DROPPED in ids:
            raise ValueError(f"tokens [{start}, {end}) of sequence {seq} layer {layer} include blocks H2O dropped")
        blocks = self.tiers.gather(ids, self.device)  # [n, 2, H, B, D]
        kv = blocks.permute(1, 0, 3, 2, 4).reshape(2, -1, self.spec.num_kv_heads, self.spec.head_dim)
        kv = kv[:, start - first * b: end - first * b]
        return kv[0], kv[1]

    # -- attend ------------------------------------------------------------------------------
    def attend(self, seq: int, layer: int, q: torch.Tensor, mode: str | Policy = "dense", budget: int = 4096,
               measure_mass: bool = False, epsilon: float | None = None) -> torch.Tensor:
        """Decode attention of q [num_q_heads, head_dim] over one layer of `seq` -> [num_q_heads, head_dim].

        mode: one of MODES (kvstore/decode/modes.py; docs/decode.md, Modes): "dense" (exact), "topk" (Quest's
        bound: fast), "cascade", "sketch" (certified omitted mass in stats()["attend"]), "window", "h2o", or a
        policy instance whose fields are its settings (e.g. `SketchTopK(coarse_factor=4)`).
        epsilon (sketch): adaptive budget: grow the selection in power-of-two block counts until the certified
        omitted softmax mass is <= epsilon for every kv head, or `budget` tokens are selected. A decode token runs
        through the DecodeStep's code where it can (kvstore/decode/eager_step.py), else through the DecodePath."""
        table = self._table(seq, layer)
        policy = self._policy(mode)
        self.check_query(q, budget)
        if table.num_dropped and not isinstance(policy, type(self.policies["h2o"])):
            raise ValueError(f"sequence {seq} layer {layer}: h2o mode dropped blocks; only mode='h2o' can attend it")
        out = self.steps.attend(seq, layer, q, mode, budget, measure_mass, epsilon)  # None: settled, falls back
        if out is not None:
            return out
        if table.num_tokens == 0:
            raise ValueError(f"sequence {seq} layer {layer} holds no tokens to attend to")
        if reads_codes(policy):
            self.unread.load_if_needed(seq)  # an opened sequence reads its sketch codes now
        return self.decode.attend(table, q, policy, budget, measure_mass, epsilon)

    def decode_step(self, seq: int, mode: str | Policy = "topk", budget: int = 4096,
                    capacity_tokens: int | None = None) -> DecodeStep:
        """A DecodeStep for `seq`: append + select + attend for every layer of a token from device state,
        capturable in one CUDA graph (kvstore/decode/step.py); mode: one of its modes or a policy instance of
        settings it implements (eager_step.step_mode). Capacity: the length + max(16K, 1/16 of it)."""
        self.table(seq, 0)
        return self.steps.build(seq, mode, budget, capacity_tokens)

    def _policy(self, mode: str | Policy) -> Policy | None:
        return resolve_policy(mode, self.policies, self.config.sketch_codes)

    def check_query(self, q: torch.Tensor, budget: int) -> None:
        check_query(q, budget, self.spec, self.device)  # ValueError unless q is fp16 [Hq, D] on the device, budget > 0

    # -- introspection -----------------------------------------------------------------------
    def stats(self) -> dict:
        self.steps.settle_all()
        live = [tables for seq, tables in self.sequences.items() if seq not in self.contexts.freeing]
        tokens = sum(tables[0].num_tokens for tables in live)
        tiers = self.tiers.stats()  # its tiers, then integrity_errors, missing_blocks, cooling_failures
        return {"tiers": tiers.pop("tiers"), "blocks": self.tiers.blocks.sharing(),
                "sequences": {"count": len(live), "tokens": tokens, "freeing_blocks": self.freeing_blocks()}, **tiers,
                "attend": self.decode.stats.as_dict()}

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant is broken."""
        self.steps.settle_all()
        self.tiers.check_integrity()
        self.tiers.blocks.check_tables(self.sequences, self.config.block_tokens, HOT_TIER, self.contexts.freeing)

    def close(self) -> None:
        self.saves.close()  # aborts saves before their commit, waits for their writers
        self.loads.close()  # before the values store its threads read closes
        self.tiers.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_max_blocks(max_blocks: int | None) -> int | None:
    if max_blocks is not None and (not is_int(max_blocks) or max_blocks < 0):
        raise ValueError(f"max_blocks must be an int >= 0 or None, got {max_blocks!r}")
    return max_blocks


__all__ = ["CapacityError", "KVStore", "MODES"]
