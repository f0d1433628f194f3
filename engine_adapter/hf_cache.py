"""A transformers Cache whose K/V live in a KVStore, so an unmodified HF model decodes with kvtier.

    cache = KVTierCache(store)
    out = hf_model.generate(input_ids, cache=cache, max_new_tokens=16, do_sample=False)
    cache.free()

Each layer's update() appends the new K/V (RoPE already applied by the model) to the
store as fp16 and returns the store's dense read-back, cast to the model's dtype.
Batch size 1 only; beam search and cropping are refused, since one store sequence
is one cache row. Run under torch.no_grad() (generate() does), not torch.inference_mode():
store tables grown inside inference mode cannot be updated outside it.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class KVTierLayer(CacheLayerMixin):
    """One decoder layer of one store sequence."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, store, seq: int, layer: int) -> None:
        super().__init__()
        self.store, self.seq, self.layer = store, seq, layer
        self.num_tokens = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key/value_states [1, Hkv, T, D] -> all of this layer's K, V [1, Hkv, S, D] in the model's dtype."""
        spec = self.store.spec
        expected = (1, spec.num_kv_heads, key_states.shape[2], spec.head_dim)
        if key_states.shape != expected or value_states.shape != expected:
            raise ValueError(
                f"KVTierCache expects key/value states of shape [1, {spec.num_kv_heads}, T, {spec.head_dim}] "
                f"(batch size 1), got {list(key_states.shape)} and {list(value_states.shape)}"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        store_device = self.store.device
        k = key_states[0].transpose(0, 1).to(store_device, torch.float16).contiguous()  # [T, Hkv, D]
        v = value_states[0].transpose(0, 1).to(store_device, torch.float16).contiguous()
        self.store.append(self.seq, self.layer, k, v)
        self.num_tokens += k.shape[0]
        keys, values = self.store.read(self.seq, self.layer)  # [S, Hkv, D] fp16
        as_model = dict(device=key_states.device, dtype=key_states.dtype)
        return keys.transpose(0, 1)[None].to(**as_model), values.transpose(0, 1)[None].to(**as_model)

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


class KVTierCache(Cache):
    """A Cache over one new store sequence; call free() (or use it as a context manager) when done."""

    def __init__(self, store, num_layers: int | None = None) -> None:
        num_layers = store.spec.num_layers if num_layers is None else num_layers
        if num_layers != store.spec.num_layers:
            raise ValueError(f"the store holds {store.spec.num_layers} layers, got num_layers={num_layers}")
        self.store = store
        self.seq = store.create_sequence()
        super().__init__(layers=[KVTierLayer(store, self.seq, i) for i in range(num_layers)])

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
        self.layers = [KVTierLayer(self.store, self.seq, i) for i in range(len(self.layers))]

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
