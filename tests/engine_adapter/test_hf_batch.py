"""KVTierCache with batch > 1: one store sequence per row, padding never stored. A left-padded batch through
transformers' generate() gives every row the tokens, logits and stored K/V it gets alone; right padding and
zeros between a row's tokens are refused before anything is stored; 4-D masks are applied when they equal
what the cache attends; sequences of different lengths continue as a left-padded batch."""

from __future__ import annotations

import pytest
import torch

from kvstore import KVStore
from tests.engine_adapter import smollm2
from tests.engine_adapter.test_llama import TINY, store_for, tiny_hf

pytest.importorskip("transformers")
from engine_adapter.hf_cache import KVTierCache  # noqa: E402
from tests.engine_adapter.test_hf_attention import config  # noqa: E402
from tests.engine_adapter.test_hf_cache import generate, kvtier_attention, tiny_prompt  # noqa: E402

NUM_NEW = 3  # tokens generated per row: the first from the prefill, two decode steps through the store


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, S], attention_mask [B, S]): each prompt after pads up to the longest."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    return ids, torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])


def generate_batch(model, ids: torch.Tensor, mask: torch.Tensor | None, cache, n: int = NUM_NEW):
    """Greedy tokens [B, n] and the logits they came from ([n] x [B, vocab])."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:].tolist(), out.logits


def stored(store: KVStore, seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [store.read(seq, layer) for layer in range(store.spec.num_layers)]


def smollm2_prompts() -> list[list[int]]:
    prose = smollm2.prose_ids()
    return [list(prose[0:14]), list(prose[100:109]), list(prose[200:205])]  # 14, 9 and 5 tokens


def test_a_left_padded_batch_generates_every_row_as_it_does_alone() -> None:
    hf_model, tokenizer, _ = smollm2.smollm2()
    prompts = smollm2_prompts()
    ids, mask = left_padded(prompts, tokenizer.pad_token_id)
    with kvtier_attention(hf_model), KVStore(config()) as store:
        other = store.create_sequence()  # a sequence the store holds already, untouched by the cache
        other_kv = torch.randn(4, 3, 64).half()
        for layer in range(store.spec.num_layers):
            store.append(other, layer, other_kv, other_kv)
        with KVTierCache(store) as cache:
            batch_tokens, batch_logits = generate_batch(hf_model, ids, mask, cache)
            assert len(cache.seqs) == 3 and other not in cache.seqs  # one sequence per row
            assert store.stats()["sequences"]["count"] == 4
            held = [len(p) + NUM_NEW - 1 for p in prompts]  # the row's tokens, never its pads
            assert [store.table(seq, 29).num_tokens for seq in cache.seqs] == held
            assert cache.get_seq_length() == ids.shape[1] + NUM_NEW - 1  # positions, pads included
            assert cache.decode_reads().num_steps == 3 * (NUM_NEW - 1)  # each row's token through store.attend
            batch_kv = [stored(store, seq) for seq in cache.seqs]
        assert store.stats()["sequences"]["count"] == 1  # the rows freed on exit, the other sequence kept
        torch.testing.assert_close(store.read(other, 29)[0], other_kv, rtol=0, atol=0)
        for row, prompt in enumerate(prompts):
            with KVTierCache(store) as cache:
                alone_tokens, alone_logits = generate_batch(hf_model, torch.tensor([prompt]), None, cache)
                alone_kv = stored(store, cache.seq)
            assert batch_tokens[row] == alone_tokens[0]
            for step, (ours, alone) in enumerate(zip(batch_logits, alone_logits)):
                err = float((ours[row] - alone[0]).abs().max() / alone[0].abs().max())
                assert err < (1e-5 if step == 0 else 2e-3), f"row {row} step {step}: relative logit error {err:.1e}"
            for ours, alone in (kv for layer in zip(batch_kv[row], alone_kv) for kv in zip(*layer)):
                # the prompt's K/V: the batch's fp32 matmuls round apart from the row's alone by ~1e-6, which
                # moves a value by at most one fp16 step (measured: 8.5e-7 beyond it)
                torch.testing.assert_close(ours[:len(prompt)], alone[:len(prompt)], rtol=2**-10, atol=1e-5)
                # the generated tokens': their hidden states attended those K/V (measured: 8.5e-4 of the largest)
                assert float((ours - alone)[len(prompt):].abs().max()) <= 5e-3 * float(alone.abs().max())
        store.check_integrity()


@pytest.mark.parametrize("where,refusal", [("right", "right padding"), ("inside", "zeros between its tokens")])
def test_right_padding_and_zeros_inside_a_row_are_refused_with_the_store_unchanged(where: str, refusal: str) -> None:
    hf_model, tokenizer, _ = smollm2.smollm2()
    ids, mask = left_padded(smollm2_prompts(), tokenizer.pad_token_id)
    if where == "right":  # row 1's pads moved after its tokens
        ids[1], mask[1] = ids[1].roll(-5), mask[1].roll(-5)
    else:
        mask[1, 8] = 0  # a zero between row 1's tokens
    with kvtier_attention(hf_model), KVStore(config()) as store, KVTierCache(store) as cache:
        with pytest.raises(ValueError, match=refusal):
            generate_batch(hf_model, ids, mask, cache)
        assert cache.get_seq_length() == 0 and store.stats()["sequences"] == {"count": 1, "tokens": 0, "freeing_blocks": 0}
        assert all(layer.staged is None for layer in cache.layers)
        store.check_integrity()


def test_sequences_of_different_lengths_continue_as_a_left_padded_batch() -> None:
    from engine_adapter.decoder import Decoder
    from engine_adapter.weights import llama_from_hf

    hf = tiny_hf("llama3", tied=False, seed=3)
    prompts = [tiny_prompt(40, seed=1)[0].tolist(), tiny_prompt(23, seed=2)[0].tolist()]
    expected = [generate(hf, torch.tensor([p]), 6) for p in prompts]  # HF's SDPA and DynamicCache, alone
    ids, mask = left_padded(prompts, 0)
    with kvtier_attention(hf), store_for(TINY, hot_tokens=1024) as store:
        decoder, seqs = Decoder(llama_from_hf(hf), store), []
        for prompt in prompts:  # every prompt token but the last, prefilled by the compact decoder
            seqs.append(store.create_sequence())
            decoder.prefill(seqs[-1], prompt[:-1])
        with KVTierCache(store, seq=seqs) as cache:
            assert cache.seqs == tuple(seqs) and cache.get_seq_length() == 39  # the shorter row: 17 pads first
            with cache.fork() as forked:
                assert forked.get_seq_length() == 39 and len(set(forked.seqs) | set(seqs)) == 4
                assert generate_batch(hf, ids, mask, forked, 6)[0] == expected
            assert generate_batch(hf, ids, mask, cache, 6)[0] == expected  # generate() runs the last column on
            assert [store.table(seq, 1).num_tokens for seq in seqs] == [45, 28]
        assert store.stats()["sequences"]["count"] == 0
        store.check_integrity()


def test_a_4d_mask_is_applied_when_it_is_what_the_cache_attends_and_refused_otherwise() -> None:
    hf = tiny_hf("default", tied=True, seed=11)
    ids, mask = left_padded([tiny_prompt(12, seed=12)[0].tolist(), tiny_prompt(7, seed=13)[0].tolist()], 0)
    real = mask.bool()
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # as generate() derives them
    applied = (torch.ones(12, 12, dtype=torch.bool).tril()[None] & real[:, None, :] & real[:, :, None])[:, None]
    additive = torch.zeros(applied.shape).masked_fill(~applied, float("-inf"))  # [B, 1, T, S]
    sees_a_pad = applied.clone()
    sees_a_pad[1, 0, 9, 2] = True  # row 1's token at 9 sees the pad at 2
    pad_sees_itself = applied.clone()
    pad_sees_itself[1, 0, 0, 0] = True  # a pad query that sees itself reads as a token before row 1's pads
    with torch.no_grad(), kvtier_attention(hf), store_for(TINY, hot_tokens=1024) as store:
        with KVTierCache(store) as cache:
            # the 2-D path
            expected = hf(ids, attention_mask=mask, position_ids=positions, past_key_values=cache).logits
            with pytest.raises(ValueError, match="hold padding"):  # then no mask: the pads would count as tokens
                hf(ids[:, -1:], past_key_values=cache)
        for mask_4d in (applied, additive):
            with KVTierCache(store) as cache:
                ours = hf(ids, attention_mask=mask_4d, position_ids=positions, past_key_values=cache).logits
                torch.testing.assert_close(ours[real], expected[real], rtol=0, atol=0)
        for mask_4d, refusal in ((sees_a_pad, "4-D mask that allows exactly"), (pad_sees_itself, "between its tokens")):
            with KVTierCache(store) as cache:
                with pytest.raises(ValueError, match=refusal):
                    hf(ids, attention_mask=mask_4d, position_ids=positions, past_key_values=cache)
                assert [store.table(seq, 0).num_tokens for seq in cache.seqs] == [0, 0]
        store.check_integrity()
