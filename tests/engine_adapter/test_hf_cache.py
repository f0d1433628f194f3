"""An unmodified HF model generating with KVTierCache: same tokens as with its own DynamicCache."""

from __future__ import annotations

import pytest
import torch

from kvstore import Config, KVStore, ModelSpec
from tests.engine_adapter import smollm2
from tests.engine_adapter.test_llama import TINY, store_for, tiny_hf

pytest.importorskip("transformers")
from engine_adapter.hf_cache import KVTierCache  # noqa: E402


def generate(model, ids: torch.Tensor, n: int, cache=None) -> list[int]:
    kwargs = {} if cache is None else {"cache": cache}
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kwargs)
    return out[0, ids.shape[1]:].tolist()


def test_tiny_model_generates_the_same_tokens_and_stores_every_position() -> None:
    hf = tiny_hf("llama3", tied=False, seed=3)
    ids = torch.randint(0, 101, (1, 150), generator=torch.Generator().manual_seed(4))
    with store_for(TINY) as store:  # hot 64 tokens: most of the prompt is read back from int8 blocks
        with KVTierCache(store) as cache:
            ours = generate(hf, ids, 12, cache)
            assert cache.get_seq_length() == 150 + 11  # the last token is never fed back
            assert store.stats()["tiers"]["warm"]["blocks"] > 0
            store.check_integrity()
        assert store.stats()["sequences"]["count"] == 0  # freed on exit
    with store_for(TINY, hot_tokens=1024) as store, KVTierCache(store) as cache:
        exact = generate(hf, ids, 12, cache)
    assert exact == generate(hf, ids, 12)
    assert sum(a == b for a, b in zip(ours, exact)) >= 9  # int8 K/V may flip a late near-tie


def test_update_returns_the_stores_read_back_in_the_models_dtype() -> None:
    with store_for(TINY) as store, KVTierCache(store) as cache:
        k = torch.randn(1, TINY.num_kv_heads, 40, TINY.head_dim)
        v = torch.randn(1, TINY.num_kv_heads, 40, TINY.head_dim)
        keys, values = cache.update(k, v, 1)
        assert keys.dtype == torch.float32 and keys.shape == (1, TINY.num_kv_heads, 40, TINY.head_dim)
        torch.testing.assert_close(keys, k.half().float())
        torch.testing.assert_close(values, v.half().float())
        assert cache.get_seq_length(1) == 40 and cache.get_mask_sizes(3, 1) == (43, 0)
        cache.reset()
        assert cache.get_seq_length(1) == 0 and store.stats()["sequences"]["count"] == 1


def test_refuses_batches_beams_and_geometry_mismatch() -> None:
    with store_for(TINY) as store, KVTierCache(store) as cache:
        with pytest.raises(ValueError, match="batch size 1"):
            cache.update(torch.randn(2, 2, 4, 16), torch.randn(2, 2, 4, 16), 0)
        with pytest.raises(ValueError, match="beam search"):
            cache.reorder_cache(torch.tensor([0]))
        with pytest.raises(ValueError, match="expanding the batch"):
            cache.batch_repeat_interleave(2)
        with pytest.raises(ValueError, match="num_layers=3"):
            KVTierCache(store, num_layers=3)
        assert store.stats()["tiers"]["hot"]["blocks"] == 0  # nothing half-written


def test_smollm2_generates_the_same_tokens_as_dynamic_cache() -> None:
    hf_model, _, _ = smollm2.smollm2()
    prompt = smollm2.prose_ids()[:2000]
    spec = ModelSpec.preset("smollm2-135m")
    config = Config(model=spec, block_tokens=32, sink_tokens=64, hot_tokens=4096, warm_tokens=32768,
                    gpu_bytes=512 << 20, cpu_bytes=64 << 20, device="cpu")
    with KVStore(config) as store, KVTierCache(store) as cache:
        ours = generate(hf_model, torch.tensor([prompt]), 16, cache)
        store.check_integrity()
    assert tuple(ours) == smollm2.hf_greedy(2000, 16)[0]
