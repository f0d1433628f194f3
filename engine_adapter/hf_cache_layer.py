"""KVTierLayer: one decoder layer of a KVTierCache, over one store sequence per batch row.

update() stages the new K/V [B, T, Hkv, D] (fp16, RoPE applied by the model) and returns the model's own K/V
tagged with the layer; kvtier attention (engine_adapter/hf_attention.py) checks the step, then commit() appends
each row's tokens among them (never its padding) to the row's sequence, or discard() drops them.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from eviction import Policy
from kvstore.store import KVStore

LAYER_ATTRIBUTE = "kvtier_layer"  # set by KVTierLayer.update on the key tensor it returns; the attention reads it


class KVTierLayer(CacheLayerMixin):
    """One decoder layer of the cache's rows, attended with the cache's mode and budget."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, store: KVStore, seqs: tuple[int, ...], layer: int, mode: str | Policy, budget: int,
                 num_columns: int) -> None:
        super().__init__()
        self.store, self.seqs, self.layer = store, seqs, layer
        self.mode, self.budget = mode, budget
        self.num_tokens = [store.table(seq, layer).num_tokens for seq in seqs]  # tokens each row's sequence holds
        self.num_columns = num_columns  # positions the model gave this layer, padding included (each row alike)
        self.num_decode_steps = 0  # store.attend calls made through this layer (one per row and decode step)
        self.staged: tuple[torch.Tensor, torch.Tensor] | None = None  # K/V [B, T, Hkv, D] fp16 awaiting commit()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """key/value_states [B, Hkv, T, D], staged for commit() -> the same K/V, the keys tagged for kvtier attention
        (which reads each row's earlier K/V from the store itself)."""
        self._check(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        as_store = dict(device=self.store.device, dtype=torch.float16)
        self.staged = (key_states.transpose(1, 2).to(**as_store).contiguous(),  # [B, T, Hkv, D]
                       value_states.transpose(1, 2).to(**as_store).contiguous())
        keys = key_states.view_as(key_states)  # a new tensor object to tag, the model's own untouched
        setattr(keys, LAYER_ATTRIBUTE, self)
        return keys, value_states

    def _check(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        spec, rows = self.store.spec, len(self.seqs)
        expected = (rows, spec.num_kv_heads, key_states.shape[2], spec.head_dim)
        if key_states.shape != expected or value_states.shape != expected:
            raise ValueError(
                f"KVTierCache expects key/value states of shape [{rows}, {spec.num_kv_heads}, T, {spec.head_dim}] "
                f"({rows} batch rows, one store sequence each), got {list(key_states.shape)} and "
                f"{list(value_states.shape)}"
            )

    def commit(self, real: torch.Tensor | None = None) -> None:
        """Append the staged K/V to the store: each row's positions that real [B, T] bool marks (None: all) to the
        row's sequence. kvtier attention calls it once the step passed its checks."""
        if self.staged is None:
            raise ValueError(f"KVTierCache layer {self.layer}: nothing staged; each update() is attended once")
        (k, v), self.staged = self.staged, None
        for row, seq in enumerate(self.seqs):
            keep = slice(None) if real is None else real[row].to(k.device)
            k_row, v_row = k[row, keep], v[row, keep]  # [t, Hkv, D]
            if k_row.shape[0]:
                self.store.append(seq, self.layer, k_row, v_row)
                self.num_tokens[row] += k_row.shape[0]
        self.num_columns += k.shape[1]

    def discard(self) -> None:
        """Drop the staged K/V: the step was refused and the store never sees it."""
        self.staged = None

    def attended(self) -> None:
        """Called by kvtier attention once a row's decode token attended through the store."""
        self.num_decode_steps += 1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.num_columns + query_length, 0

    def get_seq_length(self) -> int:
        return self.num_columns

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        """No-op: the store's placement policy decides where blocks live."""

    def prefetch(self) -> None:
        """No-op: the decode path stages cold blocks itself."""
