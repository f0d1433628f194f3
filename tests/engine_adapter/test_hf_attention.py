"""SmolLM2-135M, unmodified, through transformers' generate() with KVTierCache + kvtier attention:
dense equals HF's own greedy output; top-K at 1/8 of the context answers a passkey like dense while
reading about its budget per decode step (the window control at the same budget misses it); masks either
decode the same tokens as transformers' own SDPA run (left padding included) or are refused with nothing stored.
Batches of rows: test_hf_batch.py."""

from __future__ import annotations

import pytest
import torch

from engine_adapter.evaluate import passkey_prompt, read_passkey
from kvstore import Config, KVStore, ModelSpec
from tests.engine_adapter import smollm2

pytest.importorskip("transformers")
from engine_adapter.hf_cache import KVTierCache  # noqa: E402
from tests.engine_adapter.test_hf_cache import generate, kvtier_attention  # noqa: E402
from transformers import DynamicCache  # noqa: E402

PASSKEY_TOKENS, PASSKEY_DEPTH, PASSKEY = 2000, 0.5, "13821"
MASK_PROMPT_TOKENS, NUM_PADS = 40, 5
BUDGET = PASSKEY_TOKENS // 8 // 32 * 32  # 224: at most 1/8 of the context, whole blocks


def config() -> Config:
    # recent_tokens 64 leaves most of the budget to top-K's picks (as in test_passkey.py)
    return Config(model=ModelSpec.preset("smollm2-135m"), block_tokens=32, sink_tokens=64, hot_tokens=4096,
                  warm_tokens=32768, recent_tokens=64, gpu_bytes=512 << 20, cpu_bytes=64 << 20, device="cpu")


def test_dense_generate_equals_hf_greedy_token_for_token() -> None:
    hf_model, _, _ = smollm2.smollm2()
    expected, _ = smollm2.hf_greedy(1200, 12)  # HF's SDPA and DynamicCache, fp32 K/V
    with kvtier_attention(hf_model), KVStore(config()) as store, KVTierCache(store) as cache:
        ours = generate(hf_model, torch.tensor([smollm2.prose_ids()[:1200]]), 12, cache)
        assert cache.decode_reads().num_steps == 11
        store.check_integrity()
    assert tuple(ours) == expected


def test_topk_at_an_eighth_answers_the_passkey_like_dense_and_reads_about_its_budget(
        request: pytest.FixtureRequest) -> None:
    hf_model, tokenizer, _ = smollm2.smollm2()
    ids = torch.tensor([passkey_prompt(tokenizer, PASSKEY_TOKENS, PASSKEY_DEPTH, PASSKEY)])
    answers, reads = {}, {}
    with kvtier_attention(hf_model), KVStore(config()) as store, KVTierCache(store) as prefilled:
        with torch.no_grad():
            hf_model(ids[:, :-1], past_key_values=prefilled, logits_to_keep=1)  # one SDPA prefill for every mode
        for mode in ("dense", "topk", "window"):
            with prefilled.fork(mode, BUDGET) as cache:
                answers[mode] = read_passkey(tokenizer.decode(generate(hf_model, ids, 5, cache)))
                reads[mode] = cache.decode_reads()
        store.check_integrity()
    terminal = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if terminal is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # shown in every run, not only on failure
            terminal.write_line("\nSmolLM2 via generate(), passkey at 2K tokens, budget 224:\n" + "\n".join(
                f"  {mode:<7}{answers[mode] or '-':>7}  {reads[mode]}" for mode in answers))
    assert answers["dense"] == PASSKEY and answers["topk"] == PASSKEY, answers
    assert answers["window"] != PASSKEY, answers  # the budget alone does not reach the needle
    token_bytes = 2 * 3 * 64 * 2  # fp16 K and V, 3 kv heads of 64 dims, one layer
    dense, topk = reads["dense"], reads["topk"]
    assert dense.tokens_per_layer > PASSKEY_TOKENS and dense.bytes_per_step == dense.dense_bytes_per_step
    assert BUDGET - 32 <= topk.tokens_per_layer <= BUDGET  # ~budget, not ~context
    assert topk.bytes_per_step == topk.tokens_per_layer * 30 * token_bytes
    assert topk.bytes_per_step * 8 < dense.bytes_per_step


def test_generate_cli_hf_engine_prints_text_and_bytes_per_step(
        tmp_path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    from engine_adapter import generate_cli, weights
    from tests.engine_adapter.test_llama_cli import parse

    hf_model, tokenizer, _ = smollm2.smollm2()
    monkeypatch.setattr(weights, "load_hf", lambda name: (hf_model, tokenizer))  # the model this process loaded
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(tokenizer.decode(smollm2.prose_ids()[:400]), encoding="utf-8")
    args = parse("--engine", "hf", "--prompt-file", str(prompt), "--mode", "window", "--budget", "160",
                 "--max-new-tokens", "3", "--chunk-tokens", "256", "--device", "cpu")
    with kvtier_attention(hf_model):  # restores the shared model's attention after the CLI switched it
        assert generate_cli.run(args) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "\nhot " in err and "transformers' generate()" in err
    found = re.search(r"decode read ([\d.,]+) KiB of K/V per step \(([\d,]+) tokens per layer of a ([\d,]+)-token", err)
    assert found, err
    kib, tokens, context = (float(g.replace(",", "")) for g in found.groups())
    assert 128 <= tokens <= 160 and context > 390
    assert kib == pytest.approx(tokens * 30 * 768 / 1024, rel=1e-2)  # the printed tokens are a rounded mean
    with pytest.raises(SystemExit, match="--engine hf runs a packaged model"):
        generate_cli.run(parse("--engine", "hf", "--prompt", "hi", "--random-weights"))


def generate_masked(model, ids: torch.Tensor, mask: torch.Tensor, n: int, cache=None) -> list[int]:
    kwargs = {} if cache is None else {"past_key_values": cache}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0, **kwargs)
    return out[0, ids.shape[1]:].tolist()


def forward_greedy(model, ids: torch.Tensor, mask_for, n: int, cache) -> list[int]:
    """Greedy tokens by forward() alone (generate() takes 2-D masks only), each step given
    mask_for(num_queries, num_keys)."""
    tokens, step = [], ids
    with torch.no_grad():
        for _ in range(n):
            mask = mask_for(step.shape[1], cache.get_seq_length() + step.shape[1])
            tokens.append(int(model(step, attention_mask=mask, past_key_values=cache).logits[0, -1].argmax()))
            step = torch.tensor([tokens[-1:]])
    return tokens


def same_as_sdpa_or_refused(run) -> str:
    """run(model, cache) under transformers' SDPA (DynamicCache) and under kvtier: "same" when the tokens are
    identical, "refused" when kvtier raised a ValueError saying what it supports with nothing stored."""
    hf_model, _, _ = smollm2.smollm2()
    expected = run(hf_model, DynamicCache(config=hf_model.config))
    with kvtier_attention(hf_model), KVStore(config()) as store, KVTierCache(store) as cache:
        try:
            ours = run(hf_model, cache)
        except ValueError as refusal:
            assert "zeros only before each row's first token" in str(refusal), refusal
            assert all(store.table(cache.seq, i).num_tokens == 0 for i in range(store.spec.num_layers))
            assert all(layer.staged is None for layer in cache.layers) and cache.get_seq_length() == 0
            store.check_integrity()
            return "refused"
    assert ours == expected
    return "same"


def padded(where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [1, S], attention_mask [1, S]): the prompt with pads before or after it, or with a run of zeros."""
    ids = torch.tensor([smollm2.prose_ids()[:MASK_PROMPT_TOKENS]])
    ones, pads = torch.ones_like(ids), torch.zeros(1, NUM_PADS, dtype=torch.long)
    if where == "left":
        return torch.cat([pads, ids], 1), torch.cat([pads, ones], 1)
    if where == "right":
        return torch.cat([ids, pads], 1), torch.cat([ones, pads], 1)
    return ids, ones.index_fill(1, torch.arange(20, 30), 0)  # zeros at 20..29 change SDPA's continuation


@pytest.mark.parametrize("where,outcome", [("left", "same"), ("right", "refused"), ("zeros inside", "refused")])
def test_generate_with_a_padded_prompt_gives_the_sdpa_tokens_or_is_refused_before_anything_is_stored(
        where: str, outcome: str) -> None:
    ids, mask = padded(where)  # left: the pads are never stored, positions come from the mask
    assert same_as_sdpa_or_refused(lambda model, cache: generate_masked(model, ids, mask, 4, cache)) == outcome


def test_generate_with_an_all_ones_mask_gives_the_sdpa_tokens() -> None:
    ids = torch.tensor([smollm2.prose_ids()[:MASK_PROMPT_TOKENS]])
    run = lambda model, cache: generate_masked(model, ids, torch.ones_like(ids), 4, cache)  # noqa: E731
    assert same_as_sdpa_or_refused(run) == "same"


def causal_4d(num_queries: int, num_keys: int) -> torch.Tensor:
    return torch.ones(1, 1, num_queries, num_keys, dtype=torch.bool).tril(num_keys - num_queries)  # [1, 1, T, S]


def prefix_hidden_4d(num_queries: int, num_keys: int) -> torch.Tensor:
    """Causal, except that queries past the first 8 positions do not see those 8."""
    mask = causal_4d(num_queries, num_keys)
    mask[..., torch.arange(num_keys - num_queries, num_keys) >= 8, :8] = False
    return mask


@pytest.mark.parametrize("mask_for,outcome", [
    (causal_4d, "same"),
    (lambda num_queries, num_keys: torch.ones(1, num_keys, dtype=torch.long), "same"),  # 2-D, all ones
    (prefix_hidden_4d, "refused"),
], ids=["4-D causal", "2-D all ones", "4-D custom"])
def test_forward_with_an_explicit_mask_gives_the_sdpa_tokens_or_is_refused(mask_for, outcome: str) -> None:
    ids = torch.tensor([smollm2.prose_ids()[:MASK_PROMPT_TOKENS]])
    assert same_as_sdpa_or_refused(lambda model, cache: forward_greedy(model, ids, mask_for, 3, cache)) == outcome
