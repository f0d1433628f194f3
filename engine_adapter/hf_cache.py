"""A transformers Cache whose K/V live in a KVStore, so an unmodified HF model decodes with kvtier.

    register()                                   # engine_adapter.hf_attention: attn_implementation="kvtier"
    model.set_attn_implementation("kvtier")
    with KVTierCache(store, mode="topk", budget=512) as cache:
        out = model.generate(input_ids, cache=cache, max_new_tokens=16, do_sample=False)
        print(cache.decode_reads())

Each layer's update() stages the new K/V (RoPE already applied by the model) as fp16 and returns
them tagged with its layer; the kvtier attention function (engine_adapter/hf_attention.py) checks
the step (mask, layer count), appends the staged K/V to the store, and attends: a decode step (one
token) through `store.attend` with the cache's mode and budget, no dense read-back; a prefill chunk
by SDPA over what the store held before it (read once per chunk) followed by its own K/V. Staged
K/V that no kvtier attention appended (the model runs another attention implementation) are refused
at the next update, the next layer's in the same forward: before any token comes out, and with
every staged K/V dropped, so the store holds only whole steps.

Batch size 1 only; beam search and cropping are refused, since one store sequence is one cache
row. Run under torch.no_grad() (generate() does), not torch.inference_mode(): store tables grown
inside inference mode cannot be updated outside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from eviction import Policy
from kvstore.store import MODES, KVStore

NAME = "kvtier"  # the attn_implementation engine_adapter/hf_attention.py registers
LAYER_ATTRIBUTE = "kvtier_layer"  # set by KVTierLayer.update on the key tensor it returns; the attention reads it


class KVTierLayer(CacheLayerMixin):
    """One decoder layer of one store sequence, attended with the cache's mode and budget."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, store: KVStore, seq: int, layer: int, mode: str | Policy, budget: int) -> None:
        super().__init__()
        self.store, self.seq, self.layer = store, seq, layer
        self.mode, self.budget = mode, budget
        self.num_tokens = 0  # tokens the store holds for this layer
        self.num_decode_steps = 0  # store.attend calls made through this layer
        self.staged: tuple[torch.Tensor, torch.Tensor] | None = None  # K/V [T, Hkv, D] fp16 awaiting commit()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key/value_states [1, Hkv, T, D], staged for commit() -> decode (T = 1): the same token, tagged for
        kvtier attention; prefill: the store's earlier K/V then this chunk's, [1, Hkv, S, D] in the model's dtype."""
        self._check(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        store_device, num_before = self.store.device, self.num_tokens
        k = key_states[0].transpose(0, 1).to(store_device, torch.float16).contiguous()  # [T, Hkv, D]
        v = value_states[0].transpose(0, 1).to(store_device, torch.float16).contiguous()
        self.staged = (k, v)
        keys, values = key_states.view_as(key_states), value_states
        if key_states.shape[2] > 1 and num_before:
            old_keys, old_values = self.store.read(self.seq, self.layer, 0, num_before)  # [S0, Hkv, D] fp16
            as_model = dict(device=key_states.device, dtype=key_states.dtype)
            keys = torch.cat([old_keys.transpose(0, 1)[None].to(**as_model), key_states], dim=2)
            values = torch.cat([old_values.transpose(0, 1)[None].to(**as_model), value_states], dim=2)
        setattr(keys, LAYER_ATTRIBUTE, self)
        return keys, values

    def _check(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        spec = self.store.spec
        expected = (1, spec.num_kv_heads, key_states.shape[2], spec.head_dim)
        if key_states.shape != expected or value_states.shape != expected:
            raise ValueError(
                f"KVTierCache expects key/value states of shape [1, {spec.num_kv_heads}, T, {spec.head_dim}] "
                f"(batch size 1), got {list(key_states.shape)} and {list(value_states.shape)}"
            )

    def commit(self) -> None:
        """Append the staged K/V to the store: kvtier attention, once the step passed its checks."""
        if self.staged is None:
            raise ValueError(f"KVTierCache layer {self.layer}: nothing staged; each update() is attended once")
        (k, v), self.staged = self.staged, None
        self.store.append(self.seq, self.layer, k, v)
        self.num_tokens += k.shape[0]

    def discard(self) -> None:
        """Drop the staged K/V: the step was refused and the store never sees it."""
        self.staged = None

    def attended(self) -> None:
        """Called by kvtier attention once the decode token's query attended through the store."""
        self.num_decode_steps += 1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.num_tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.num_tokens

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        """No-op: the store's placement policy decides where blocks live."""

    def prefetch(self) -> None:
        """No-op: the decode path stages cold blocks itself."""


@dataclass(frozen=True, slots=True)
class DecodeReads:
    """K/V the store's decode attention read for a cache, from the store's attend counters."""

    num_steps: int  # decode steps (tokens fed back), each attending every layer
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
    """A Cache over one store sequence; call free() (or use it as a context manager) when done.

    mode: "dense", "topk", "sketch", "h2o", "window" or an eviction.Policy instance; budget: tokens each
    sparse decode step attends per layer (sinks and the recent window included).
    seq: a store sequence to continue (e.g. `store.open(name)`, `store.create_sequence(prefix=...)`),
    which the cache then owns and frees; by default a new empty one. generate() given the whole
    token ids then runs only the ones past what the sequence holds."""

    def __init__(self, store: KVStore, mode: str | Policy = "dense", budget: int = 4096,
                 num_layers: int | None = None, seq: int | None = None) -> None:
        num_layers = store.spec.num_layers if num_layers is None else num_layers
        if num_layers != store.spec.num_layers:
            raise ValueError(f"the store holds {store.spec.num_layers} layers, got num_layers={num_layers}")
        if not isinstance(mode, Policy) and mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} or an eviction.Policy instance, got {mode!r}")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise ValueError(f"budget must be a positive int (tokens), got {budget!r}")
        held = [store.table(seq, i).num_tokens for i in range(num_layers)] if seq is not None else []
        if len(set(held)) > 1:
            raise ValueError(f"sequence {seq} holds different token counts per layer ({min(held)}..{max(held)})")
        self.store, self.mode, self.budget = store, mode, budget
        self.seq = store.create_sequence() if seq is None else seq
        self._attend_before = store.stats()["attend"]
        super().__init__(layers=self._new_layers(num_layers))

    def _new_layers(self, num_layers: int) -> list[KVTierLayer]:
        layers = [KVTierLayer(self.store, self.seq, i, self.mode, self.budget) for i in range(num_layers)]
        for layer in layers:
            layer.num_tokens = self.store.table(self.seq, layer.layer).num_tokens
        return layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage layer_idx's new K/V (KVTierLayer.update). Refused, with every staged K/V dropped, when an
        earlier update was never attended through the store or the store has no such layer."""
        if self.seq is None:
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
        return self.layers[layer_idx].update(key_states, value_states)

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
        """A new cache over `store.fork` of this one's sequence (full blocks shared, nothing copied), so
        several modes can share one prefill; mode and budget default to this cache's."""
        if self.seq is None:
            raise ValueError("KVTierCache.fork: the cache was freed")
        mode, budget = self.mode if mode is None else mode, self.budget if budget is None else budget
        seq = self.store.fork(self.seq)
        try:
            return KVTierCache(self.store, mode, budget, len(self.layers), seq=seq)
        except BaseException:
            self.store.free(seq)
            raise

    def free(self) -> None:
        """Return the sequence's blocks to the store; the cache is empty and unusable afterwards."""
        if self.seq is not None:
            self.store.free(self.seq)
            self.seq, self.layers = None, []

    def reset(self) -> None:
        """Drop every token: free the sequence and start a fresh one."""
        if self.seq is None:
            raise ValueError("KVTierCache.reset: the cache was freed; create a new one")
        self.store.free(self.seq)
        self.seq = self.store.create_sequence()
        self._attend_before = self.store.stats()["attend"]
        self.layers = self._new_layers(len(self.layers))

    def _refuse(self, what: str) -> None:
        raise ValueError(f"KVTierCache holds one sequence (batch size 1, no beams); {what} is not supported")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._refuse("beam search (reorder_cache)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            self._refuse(f"expanding the batch {repeats}x")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if indices.numel() != 1 or int(indices.reshape(-1)[0]) != 0:
            self._refuse("selecting batch rows")

    def crop(self, max_length: int) -> None:
        self._refuse("cropping (e.g. assisted decoding)")

    def __enter__(self) -> KVTierCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()
