"""A transformers Cache whose K/V live in a KVStore, so an unmodified HF model decodes with kvtier.

    register()                                   # engine_adapter.hf_attention: attn_implementation="kvtier"
    model.set_attn_implementation("kvtier")
    with KVTierCache(store, mode="topk", budget=512) as cache:
        out = model.generate(input_ids, attention_mask=mask, past_key_values=cache, max_new_tokens=16, do_sample=False)
        print(cache.decode_reads())

One store sequence per batch row. Each layer's update() (engine_adapter/hf_cache_layer.py) stages the new K/V
(RoPE already applied by the model) as fp16 and returns them tagged with its layer; the kvtier attention function
(engine_adapter/hf_attention.py) checks the step (mask, layer count), appends each row's tokens to its sequence
(padding never: engine_adapter/hf_masks.py) and attends: a decode step (one token per row) through `store.attend`
of each row's sequence with the cache's mode and budget, no dense read-back; a prefill chunk by SDPA, per row,
over what the row's sequence held before it (read once per chunk) followed by the row's tokens of the chunk.
Staged K/V that no kvtier attention appended (the model runs another attention implementation) are refused at
the next update, the next layer's in the same forward: before any token comes out, and with every staged K/V
dropped, so the store holds only whole steps.

A cache that made its own sequence takes the batch size of the first step it sees (it makes or frees empty
sequences to match); a cache given sequences keeps one row per sequence. Batch rows stay in place: beam
search, batch expansion and cropping are refused. A step that fails part way (a full store) can leave some rows
or layers ahead of others: free the cache. Run under torch.no_grad() (generate() does), not
torch.inference_mode(): store tables grown inside inference mode cannot be updated outside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from engine_adapter.hf_cache_layer import KVTierLayer
from eviction import Policy
from kvstore.store import MODES, KVStore

NAME = "kvtier"  # the attn_implementation engine_adapter/hf_attention.py registers


@dataclass(frozen=True, slots=True)
class DecodeReads:
    """K/V the store's decode attention read for a cache, from the store's attend counters."""

    num_steps: int  # decode tokens attended (one per batch row and step), each in every layer
    num_layers: int
    attended_tokens: int  # tokens the kernel read, summed over steps and layers
    context_tokens: int  # tokens the sequence held, summed over steps and layers
    token_bytes: int  # fp16 K and V of one token in one layer (int8 warm blocks read half)

    @property
    def bytes_per_step(self) -> float:
        return self.attended_tokens * self.token_bytes / self.num_steps if self.num_steps else 0.0

    @property
    def dense_bytes_per_step(self) -> float:
        """What dense attention over the whole context reads per step."""
        return self.context_tokens * self.token_bytes / self.num_steps if self.num_steps else 0.0

    @property
    def tokens_per_layer(self) -> float:
        return self.attended_tokens / (self.num_steps * self.num_layers) if self.num_steps else 0.0

    def __str__(self) -> str:
        if not self.num_steps:
            return "no decode step attended through the store"
        context = self.context_tokens / (self.num_steps * self.num_layers)
        return (f"decode read {self.bytes_per_step / 2**10:,.1f} KiB of K/V per step ({self.tokens_per_layer:,.0f} "
                f"tokens per layer of a {context:,.0f}-token context; dense reads "
                f"{self.dense_bytes_per_step / 2**10:,.1f} KiB), over {self.num_steps} steps")


class KVTierCache(Cache):
    """A Cache over one store sequence per batch row; call free() (or use it as a context manager) when done.

    mode: "dense", "topk", "sketch", "h2o", "window" or an eviction.Policy instance; budget: tokens each
    sparse decode step attends per layer (sinks and the recent window included).
    seq: a store sequence to continue (e.g. `store.open(name)`, `store.create_sequence(prefix=...)`), or one per
    batch row, which the cache then owns and frees; by default one new empty sequence, and as many as the first
    step's batch has rows. Sequences of different lengths continue as a left-padded batch: the cache counts as
    many positions as the longest holds, a shorter one's padding first. generate() given the whole token ids
    (and, for rows of different lengths, their mask) then runs only the positions past those."""

    def __init__(self, store: KVStore, mode: str | Policy = "dense", budget: int = 4096,
                 num_layers: int | None = None, seq: int | Sequence[int] | None = None) -> None:
        num_layers = store.spec.num_layers if num_layers is None else num_layers
        if num_layers != store.spec.num_layers:
            raise ValueError(f"the store holds {store.spec.num_layers} layers, got num_layers={num_layers}")
        if not isinstance(mode, Policy) and mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} or an eviction.Policy instance, got {mode!r}")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise ValueError(f"budget must be a positive int (tokens), got {budget!r}")
        given = [] if seq is None else [seq] if isinstance(seq, int) else list(seq)
        if seq is not None and (not given or len(set(given)) != len(given)):
            raise ValueError(f"seq must be a store sequence or distinct sequences, one per batch row, got {seq!r}")
        held = [_held(store, s, num_layers) for s in given]
        self.store, self.mode, self.budget = store, mode, budget
        self.adapts = seq is None  # the cache made its rows: an empty cache follows the first step's batch size
        self.seqs: tuple[int, ...] | None = tuple(given) or (store.create_sequence(),)
        self._attend_before = store.stats()["attend"]
        super().__init__(layers=self._new_layers(num_layers, max(held, default=0)))

    def _new_layers(self, num_layers: int, num_columns: int = 0) -> list[KVTierLayer]:
        return [KVTierLayer(self.store, self.seqs, i, self.mode, self.budget, num_columns) for i in range(num_layers)]

    @property
    def seq(self) -> int | None:
        """The store sequence of a one-row cache (None once freed); `seqs` holds one per batch row."""
        if self.seqs is not None and len(self.seqs) != 1:
            raise ValueError(f"the cache holds {len(self.seqs)} batch rows: their sequences are cache.seqs")
        return None if self.seqs is None else self.seqs[0]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage layer_idx's new K/V [B, Hkv, T, D] (KVTierLayer.update). Refused, with every staged K/V dropped,
        when an earlier update was never attended through the store or the store has no such layer."""
        if self.seqs is None:
            raise ValueError("KVTierCache.update: the cache was freed; create a new one")
        unattended = [layer.layer for layer in self.layers if layer.staged is not None]
        if unattended:
            for layer in self.layers:
                layer.discard()
            raise ValueError(
                f"KVTierCache layer {unattended[0]}: its K/V never attended through the store (nothing was "
                f"stored); the model must run attn_implementation={NAME!r} (engine_adapter.hf_attention.register(), "
                f"then model.set_attn_implementation({NAME!r}))"
            )
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"the store holds {len(self.layers)} layers (ModelSpec.num_layers), got an update "
                             f"for layer {layer_idx}: the model has at least {layer_idx + 1}")
        if key_states.dim() == 4 and key_states.shape[0] != len(self.seqs) and self.adapts \
                and not any(layer.num_columns for layer in self.layers):
            self._set_rows(key_states.shape[0])
        return self.layers[layer_idx].update(key_states, value_states)

    def _set_rows(self, num_rows: int) -> None:
        """An empty cache of its own sequences takes num_rows rows: empty sequences made or freed."""
        seqs = list(self.seqs)
        while len(seqs) > max(num_rows, 1):
            self.store.free(seqs.pop())
        seqs += [self.store.create_sequence() for _ in range(num_rows - len(seqs))]
        self.seqs = tuple(seqs)
        self.layers = self._new_layers(len(self.layers))

    def decode_reads(self) -> DecodeReads:
        """What the store's decode attention read since this cache was made (or reset). The store's
        counters are shared: decode steps of other sequences in the meantime are counted too."""
        now, spec = self.store.stats()["attend"], self.store.spec
        return DecodeReads(
            num_steps=self.layers[0].num_decode_steps if self.layers else 0, num_layers=spec.num_layers,
            attended_tokens=now["attended_tokens"] - self._attend_before["attended_tokens"],
            context_tokens=now["context_tokens"] - self._attend_before["context_tokens"],
            token_bytes=spec.bytes_per_token // spec.num_layers,
        )

    def fork(self, mode: str | Policy | None = None, budget: int | None = None) -> KVTierCache:
        """A new cache over `store.fork` of each row's sequence (full blocks shared, nothing copied), with this
        one's positions, so several modes can share one prefill; mode and budget default to this cache's."""
        if self.seqs is None:
            raise ValueError("KVTierCache.fork: the cache was freed")
        mode, budget = self.mode if mode is None else mode, self.budget if budget is None else budget
        seqs: list[int] = []
        try:
            for seq in self.seqs:
                seqs.append(self.store.fork(seq))
            clone = KVTierCache(self.store, mode, budget, len(self.layers), seq=seqs)
        except BaseException:
            for seq in seqs:
                self.store.free(seq)
            raise
        for layer in clone.layers:  # padding every row shares (positions before the longest row's first token)
            layer.num_columns = self.get_seq_length()
        return clone

    def free(self) -> None:
        """Return every row's blocks to the store; the cache is empty and unusable afterwards."""
        if self.seqs is not None:
            for seq in self.seqs:
                self.store.free(seq)
            self.seqs, self.layers = None, []

    def reset(self) -> None:
        """Drop every token: free the rows' sequences and start from one fresh, empty sequence."""
        if self.seqs is None:
            raise ValueError("KVTierCache.reset: the cache was freed; create a new one")
        for seq in self.seqs:
            self.store.free(seq)
        self.seqs, self.adapts = (self.store.create_sequence(),), True
        self._attend_before = self.store.stats()["attend"]
        self.layers = self._new_layers(len(self.layers))

    def _refuse(self, what: str) -> None:
        raise ValueError(f"KVTierCache holds one store sequence per batch row, in place; {what} is not supported")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._refuse("beam search (reorder_cache)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            self._refuse(f"expanding the batch {repeats}x")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        rows = len(self.seqs or ())
        if indices.reshape(-1).tolist() != list(range(rows)):
            self._refuse(f"selecting batch rows {indices.reshape(-1).tolist()[:8]} of {rows}")

    def crop(self, max_length: int) -> None:
        self._refuse("cropping (e.g. assisted decoding)")

    def __enter__(self) -> KVTierCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()


def _held(store: KVStore, seq: int, num_layers: int) -> int:
    """Tokens `seq` holds in every layer; ValueError when its layers hold different counts."""
    held = [store.table(seq, i).num_tokens for i in range(num_layers)]
    if len(set(held)) > 1:
        raise ValueError(f"sequence {seq} holds different token counts per layer ({min(held)}..{max(held)})")
    return held[0]
