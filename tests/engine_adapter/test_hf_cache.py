"""KVTierCache under an unmodified HF model: K/V go into the store, decode steps attend through it
(kvtier attention), prefill chunks get what the store held before them, misuse is refused."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import pytest
import torch

from tests.engine_adapter.test_llama import TINY, store_for, tiny_hf

pytest.importorskip("transformers")
from engine_adapter.hf_attention import NAME, register  # noqa: E402
from engine_adapter.hf_attention import kvtier_attention as kvtier_attention_fn  # noqa: E402
from engine_adapter.hf_attention import kvtier_mask  # noqa: E402
from engine_adapter.hf_cache import KVTierCache  # noqa: E402
from transformers import DynamicCache  # noqa: E402
from transformers.masking_utils import sliding_window_causal_mask_function  # noqa: E402


@contextlib.contextmanager
def kvtier_attention(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The model with attn_implementation="kvtier" inside the block (models are shared between tests)."""
    register()
    before = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


def generate(model, ids: torch.Tensor, n: int, cache=None) -> list[int]:
    kwargs = {} if cache is None else {"past_key_values": cache}
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kwargs)
    return out[0, ids.shape[1]:].tolist()


def tiny_prompt(n: int, seed: int = 4) -> torch.Tensor:
    return torch.randint(0, 101, (1, n), generator=torch.Generator().manual_seed(seed))


def test_tiny_model_generates_the_same_tokens_and_stores_every_position() -> None:
    hf, ids = tiny_hf("llama3", tied=False, seed=3), tiny_prompt(150)
    exact = generate(hf, ids, 12)  # HF's own SDPA and DynamicCache
    with kvtier_attention(hf):
        with store_for(TINY) as store:  # hot 64 tokens: most of the prompt is attended as int8 blocks
            with KVTierCache(store) as cache:
                ours = generate(hf, ids, 12, cache)
                assert cache.get_seq_length() == 150 + 11  # the last token is never fed back
                assert store.stats()["tiers"]["warm"]["blocks"] > 0
                reads = cache.decode_reads()
                assert reads.num_steps == 11 and reads.attended_tokens == reads.context_tokens  # dense
                assert reads.context_tokens == TINY.num_layers * sum(range(151, 162))
                store.check_integrity()
            assert store.stats()["sequences"]["count"] == 0  # freed on exit
        with store_for(TINY, hot_tokens=1024) as store, KVTierCache(store) as cache:
            assert generate(hf, ids, 12, cache) == exact
    assert sum(a == b for a, b in zip(ours, exact)) >= 9  # int8 K/V may flip a late near-tie


def test_updates_stage_the_new_k_v_and_commit_stores_each_row_s_tokens() -> None:
    with store_for(TINY) as store, KVTierCache(store) as cache:
        k = torch.randn(1, TINY.num_kv_heads, 41, TINY.head_dim)
        v = torch.randn(1, TINY.num_kv_heads, 41, TINY.head_dim)
        keys, values = cache.update(k[:, :, :30], v[:, :, :30], 1)
        assert keys.shape == (1, TINY.num_kv_heads, 30, TINY.head_dim)
        torch.testing.assert_close(keys, k[:, :, :30], rtol=0, atol=0)  # the chunk's own K/V, not rounded
        assert cache.get_seq_length(1) == 0  # staged: the store gets it when kvtier attention commits it
        cache.layers[1].commit()
        keys, values = cache.update(k[:, :, 30:40], v[:, :, 30:40], 1)  # a later chunk: its own K/V only
        torch.testing.assert_close(values, v[:, :, 30:40], rtol=0, atol=0)
        cache.layers[1].commit()
        cache.update(k[:, :, 40:], v[:, :, 40:], 1)
        cache.layers[1].commit()
        stored_k, stored_v = store.read(cache.seq, 1)
        torch.testing.assert_close(stored_k, k[0].transpose(0, 1).half())
        torch.testing.assert_close(stored_v, v[0].transpose(0, 1).half())
        assert cache.get_seq_length(1) == 41 and cache.get_mask_sizes(3, 1) == (44, 0)
        cache.update(k[:, :, :1], v[:, :, :1], 0)
        with pytest.raises(ValueError, match="never attended through the store"):
            cache.update(k[:, :, :1], v[:, :, :1], 1)  # nothing attended layer 0's token
        assert store.table(cache.seq, 0).num_tokens == 0 and cache.layers[0].staged is None  # dropped, not stored
        cache.reset()
        assert cache.get_seq_length(1) == 0 and store.stats()["sequences"]["count"] == 1
        k3, v3 = (torch.randn(3, TINY.num_kv_heads, 5, TINY.head_dim) for _ in range(2))
        cache.update(k3, v3, 0)  # an empty cache of its own sequence takes the batch's three rows
        real = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)
        cache.layers[0].commit(real)
        assert len(cache.seqs) == 3 and store.stats()["sequences"]["count"] == 3
        for row, seq in enumerate(cache.seqs):  # each row's tokens, never its padding
            stored_k, stored_v = store.read(seq, 0)
            torch.testing.assert_close(stored_k, k3[row].transpose(0, 1)[real[row]].half(), rtol=0, atol=0)
            torch.testing.assert_close(stored_v, v3[row].transpose(0, 1)[real[row]].half(), rtol=0, atol=0)
        assert cache.get_seq_length(0) == 5 and cache.layers[0].num_tokens == [5, 3, 1]
        store.check_integrity()


def test_chunked_prefill_and_decode_match_hf_logits() -> None:
    hf, ids = tiny_hf("default", tied=True, seed=5), tiny_prompt(130, seed=6)
    with torch.no_grad():
        ref = hf(ids).logits[0]  # [T, V] fp32 K/V, one pass
        with kvtier_attention(hf), store_for(TINY, hot_tokens=1024) as store, KVTierCache(store) as cache:
            parts = [hf(ids[:, a:b], past_key_values=cache).logits[0] for a, b in ((0, 70), (70, 129), (129, 130))]
            store.check_integrity()
    ours = torch.cat(parts)  # chunk 2 attends the store's fp16 copy of chunk 1; the last token decodes
    err = (ours - ref).abs().max() / ref.abs().max()
    assert err < 5e-3, f"relative logit error {err:.2e} (earlier K/V rounded to fp16)"
    assert bool((ours.argmax(-1) == ref.argmax(-1)).all())


def test_misuse_is_refused() -> None:
    hf, ids = tiny_hf("default", tied=True), tiny_prompt(20)
    with store_for(TINY) as store:
        with KVTierCache(store) as cache, pytest.raises(ValueError, match="attn_implementation='kvtier'"):
            generate(hf, ids, 4, cache)  # HF's SDPA would attend the decode token alone
        with kvtier_attention(hf), pytest.raises(ValueError, match="needs a KVTierCache"):
            generate(hf, ids, 4)
        with KVTierCache(store) as cache:
            keys, _ = cache.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), 0)
            with pytest.raises(ValueError, match="sliding_window"):
                kvtier_attention_fn(hf.model.layers[0].self_attn, torch.randn(1, 6, 3, 16), keys, keys, None,
                                    sliding_window=2)
        with pytest.raises(ValueError, match="mask pattern"):  # e.g. create_sliding_window_causal_mask's
            kvtier_mask(1, 3, 3, mask_function=sliding_window_causal_mask_function(2))
        hf.config.layer_types = ["full_attention", "sliding_attention"]  # a window in the second layer only
        with kvtier_attention(hf), KVTierCache(store) as cache:
            with pytest.raises(ValueError, match=r"also has \['sliding_attention'\] layers"):
                generate(hf, ids, 2, cache)
            assert store.table(cache.seq, 0).num_tokens == 0  # refused in the first layer, before it stored
        with KVTierCache(store) as cache:
            cache.update(torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16), 0)
            cache.layers[0].commit()
            with pytest.raises(ValueError, match=r"\[1, 2, T, 16\] \(1 batch rows"):  # it holds a row's tokens
                cache.update(torch.randn(2, 2, 4, 16), torch.randn(2, 2, 4, 16), 0)
            with pytest.raises(ValueError, match="beam search"):
                cache.reorder_cache(torch.tensor([0]))
            with pytest.raises(ValueError, match="expanding the batch"):
                cache.batch_repeat_interleave(2)
            cache.batch_select_indices(torch.tensor([0]))  # every row, in place: nothing to do
            with pytest.raises(ValueError, match="selecting batch rows"):
                cache.batch_select_indices(torch.tensor([1]))
        with pytest.raises(ValueError, match="distinct sequences"):
            KVTierCache(store, seq=[])
        with pytest.raises(ValueError, match="num_layers=3"):
            KVTierCache(store, num_layers=3)
        with pytest.raises(ValueError, match="mode must be one of"):
            KVTierCache(store, mode="sparse")
        for budget in (0, -5, 1.5, True):
            with pytest.raises(ValueError, match="budget must be a positive int"):
                KVTierCache(store, mode="topk", budget=budget)
        assert store.stats()["sequences"]["count"] == 0  # the refused caches made no sequence
        ragged = store.create_sequence()
        store.append(ragged, 0, torch.randn(5, 2, 16).half(), torch.randn(5, 2, 16).half())
        with pytest.raises(ValueError, match="different token counts per layer"):
            KVTierCache(store, seq=ragged)
        store.free(ragged)
        store.check_integrity()


@pytest.mark.parametrize("max_new_tokens", [1, 2])
def test_a_model_left_on_sdpa_is_refused_before_any_token_with_nothing_stored(max_new_tokens: int) -> None:
    hf, ids = tiny_hf("default", tied=True, seed=9), tiny_prompt(20, seed=10)
    exact = generate(hf, ids, max_new_tokens)
    with store_for(TINY, hot_tokens=1024) as store, KVTierCache(store) as cache:
        with pytest.raises(ValueError, match="attn_implementation='kvtier'"):
            generate(hf, ids, max_new_tokens, cache)  # SDPA would attend a decode token alone
        assert [store.table(cache.seq, i).num_tokens for i in range(TINY.num_layers)] == [0, 0]
        with kvtier_attention(hf):  # the refused cache is still whole: switched over, it decodes exactly
            assert generate(hf, ids, max_new_tokens, cache) == exact
        store.check_integrity()


@pytest.mark.parametrize("num_store_layers", [1, 3])
def test_a_store_for_another_layer_count_is_refused_with_nothing_stored(num_store_layers: int) -> None:
    hf, ids = tiny_hf("default", tied=True), tiny_prompt(20)
    spec = dataclasses.replace(TINY, num_layers=num_store_layers)
    with kvtier_attention(hf), store_for(spec) as store, KVTierCache(store) as cache:
        with pytest.raises(ValueError, match=f"the model has 2 layers but the store holds {num_store_layers}"):
            generate(hf, ids, 2, cache)
        assert all(store.table(cache.seq, i).num_tokens == 0 for i in range(num_store_layers))
        assert all(layer.staged is None for layer in cache.layers)
        store.check_integrity()
    with store_for(spec) as store, KVTierCache(store) as cache:
        k = torch.randn(1, TINY.num_kv_heads, 3, TINY.head_dim)
        with pytest.raises(ValueError, match=f"the store holds {num_store_layers} layers .* layer {num_store_layers}"):
            cache.update(k, k, num_store_layers)  # an update past the store's layers, without kvtier attention


def test_a_4d_mask_is_applied_when_causal_and_refused_otherwise() -> None:
    hf, ids = tiny_hf("default", tied=True, seed=11), tiny_prompt(24, seed=12)
    causal = torch.ones(1, 1, 24, 24, dtype=torch.bool).tril()  # [1, 1, T, S]
    additive = torch.zeros(1, 1, 24, 24).masked_fill(~causal, float("-inf"))
    biased = additive.masked_fill(causal & (torch.arange(24) < 4), -1.0)  # a soft bias the store cannot apply
    with torch.no_grad():
        expected = hf(ids, past_key_values=DynamicCache(config=hf.config), attention_mask=causal).logits  # HF's SDPA
    with torch.no_grad(), kvtier_attention(hf), store_for(TINY, hot_tokens=1024) as store:
        for mask in (causal, additive):
            with KVTierCache(store) as cache:
                torch.testing.assert_close(hf(ids, past_key_values=cache, attention_mask=mask).logits, expected)
        for mask in (biased, causal.transpose(2, 3), causal[..., :20]):  # a bias, the future, a short mask
            with KVTierCache(store) as cache:
                with pytest.raises(ValueError, match="4-D mask that allows exactly"):
                    hf(ids, past_key_values=cache, attention_mask=mask)
                assert [store.table(cache.seq, i).num_tokens for i in range(TINY.num_layers)] == [0, 0]
        store.check_integrity()


def test_topk_reads_about_the_budget_per_step_and_fork_shares_a_prefill() -> None:
    hf, ids = tiny_hf("llama3", tied=False, seed=7), tiny_prompt(640, seed=8)
    with kvtier_attention(hf), store_for(TINY, hot_tokens=1024, recent_tokens=16) as store:
        with KVTierCache(store) as base:
            with torch.no_grad():
                hf(ids[:, :-1], past_key_values=base)  # prefill once
            for mode, budget in (("topk", 96), ("window", 96), ("dense", 4096)):
                with base.fork(mode, budget) as cache:
                    assert cache.get_seq_length() == 639 and (cache.mode, cache.budget) == (mode, budget)
                    generate(hf, ids, 6, cache)  # the last prompt token, then 5 more, attend through the store
                    reads = cache.decode_reads()
                    assert reads.num_steps == 6
                    context = reads.context_tokens / (reads.num_steps * TINY.num_layers)
                    assert 639 < context < 646
                    if mode == "dense":
                        assert reads.tokens_per_layer == context
                    else:  # whole 16-token blocks, the partial tail block included: at most the budget
                        assert budget - 16 <= reads.tokens_per_layer <= budget
                        assert reads.bytes_per_step * 6 < reads.dense_bytes_per_step
                    assert reads.bytes_per_step == reads.tokens_per_layer * TINY.num_layers * 2 * 2 * 16 * 2
            assert base.get_seq_length() == 639  # the forks never touched it
            store.check_integrity()
        assert store.stats()["sequences"]["count"] == 0


def test_continues_a_context_the_compact_decoder_prefilled_and_saved() -> None:
    from engine_adapter.decoder import Decoder
    from engine_adapter.weights import llama_from_hf

    hf, ids = tiny_hf("llama3", tied=False, seed=3), tiny_prompt(150)
    exact = generate(hf, ids, 8)
    with kvtier_attention(hf), store_for(TINY, hot_tokens=1024) as store:
        seq = store.create_sequence()
        Decoder(llama_from_hf(hf), store).prefill(seq, ids[0, :-1].tolist())
        store.save(seq, "prompt")
        store.free(seq)
        with KVTierCache(store, seq=store.open("prompt")) as cache:
            assert cache.get_seq_length() == 149
            assert generate(hf, ids, 8, cache) == exact  # generate() runs only the last prompt token on
            assert cache.decode_reads().num_steps == 8
        store.check_integrity()
        assert store.stats()["sequences"]["count"] == 0
