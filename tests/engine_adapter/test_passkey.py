"""Passkey retrieval with SmolLM2-135M at ~2K tokens (budget 1/8 of the context) and 8K (1/16): top-K (Quest's
bound) and the sketch selector find every passkey dense attention finds; window and H2O are recorded as controls
(window misses them all; H2O, which keeps the needle's heavy hitters, finds them too). At 8K a second, tighter
budget (160 tokens, 1/50) separates the selectors: the sketch and the cascade must still find every passkey dense
finds; top-K must miss one there (else the budget no longer grades them), H2O is recorded (it misses too)."""

from __future__ import annotations

import pytest

from engine_adapter.evaluate import passkey_by_mode, passkey_prompt
from engine_adapter.decoder import Decoder
from kvstore import Config, KVStore, ModelSpec
from tests.engine_adapter import smollm2

# prompt tokens -> relative depths of the needle; one prefill per depth, shared by every mode
DEPTHS = {2000: (0.1, 0.5, 0.9), 8000: (0.1, 0.6)}
FRACTION = {2000: 8, 8000: 16}  # budget = this fraction of the context
MODES = ("dense", "topk", "sketch", "window", "h2o")
TIGHT = {8000: 160}  # prompt tokens -> a second, tighter budget for the selectors
TIGHT_MODES = ("topk", "sketch", "cascade", "h2o")


def passkey_for(tokens: int, depth: float) -> str:
    return str(10000 + (tokens + int(depth * 100) + 1) * 48271 % 90000)  # distinct 5-digit keys


def budget_for(tokens: int) -> int:
    return tokens // FRACTION[tokens] // 32 * 32  # whole blocks


def config() -> Config:
    # recent_tokens 64 leaves most of a 1/8 budget to top-K's picks
    return Config(model=ModelSpec.preset("smollm2-135m"), block_tokens=32, sink_tokens=64, hot_tokens=4096,
                  warm_tokens=32768, recent_tokens=64, gpu_bytes=768 << 20, cpu_bytes=64 << 20, device="cpu")


def report(request: pytest.FixtureRequest, rows: list[dict]) -> None:
    labels = MODES + tuple(f"{m}@tight" for m in TIGHT_MODES if any(f"{m}@tight" in r["answers"] for r in rows))
    lines = [f"{'tokens':>7}{'depth':>7}{'budget':>8}{'passkey':>9}" + "".join(f"{m:>15}" for m in labels)
             + "   (* = missed)"]
    for r in rows:
        cells = "".join(f"{(r['answers'][m] or '-') + ('' if r['answers'][m] == r['key'] else '*'):>15}"
                        for m in labels)
        lines.append(f"{r['tokens']:>7}{r['depth']:>7}{r['budget']:>8}{r['key']:>9}{cells}")
    if any(r["tokens"] in TIGHT for r in rows):
        lines.append(f"(@tight: budget {TIGHT[rows[0]['tokens']]})")
    terminal = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if terminal is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # shown in every run, not only on failure
            terminal.write_line("\npasskey retrieval, SmolLM2-135M:\n" + "\n".join(lines))


@pytest.fixture(scope="module", params=sorted(DEPTHS), ids=lambda tokens: f"{tokens}tok")
def results(request: pytest.FixtureRequest) -> list[dict]:
    """One row per depth at this prompt length: the passkey each mode read back."""
    _, tokenizer, model = smollm2.smollm2()
    tokens, rows = request.param, []
    with KVStore(config()) as store:
        decoder = Decoder(model, store)
        for depth in DEPTHS[tokens]:
            key, budget = passkey_for(tokens, depth), budget_for(tokens)
            prompt = passkey_prompt(tokenizer, tokens, depth, key)
            runs: dict = {mode: budget for mode in MODES}
            if tokens in TIGHT:
                runs.update({f"{mode}@tight": (mode, TIGHT[tokens]) for mode in TIGHT_MODES})
            answers = passkey_by_mode(decoder, tokenizer, prompt, runs)
            rows.append(dict(tokens=tokens, depth=depth, key=key, budget=budget, answers=answers))
        store.check_integrity()
        assert store.stats()["sequences"]["count"] == 0
    report(request, rows)
    return rows


def test_prompts_have_the_planned_length_and_needle() -> None:
    _, tokenizer, _ = smollm2.smollm2()
    ids = passkey_prompt(tokenizer, 2000, 0.5, "31415")
    assert len(ids) == 2000
    text = tokenizer.decode(ids)
    assert text.count("31415") == 2 and 0.4 < text.index("31415") / len(text) < 0.6
    with pytest.raises(ValueError, match="5 digits"):
        passkey_prompt(tokenizer, 2000, 0.5, "314")
    with pytest.raises(ValueError, match="at least"):
        passkey_prompt(tokenizer, 20, 0.5, "31415")


def test_dense_finds_the_passkey_at_most_depths(results: list[dict]) -> None:
    found = [r for r in results if r["answers"]["dense"] == r["key"]]
    assert len(found) >= len(results) - 1, results  # otherwise the comparison below says little


@pytest.mark.parametrize("mode", ["topk", "sketch", "sketch@tight", "cascade@tight"])
def test_sparse_modes_find_every_passkey_dense_finds(results: list[dict], mode: str) -> None:
    misses = [r for r in results if mode in r["answers"] and r["answers"]["dense"] == r["key"] != r["answers"][mode]]
    assert not misses, misses


def test_window_and_h2o_controls_are_recorded(results: list[dict]) -> None:
    for r in results:
        assert r["budget"] * 8 <= r["tokens"]
        for mode in ("window", "h2o"):
            answer = r["answers"][mode]
            assert answer is None or answer.isdigit(), (mode, r)


def test_the_tight_budget_separates_the_selectors(results: list[dict]) -> None:
    """The tight budget is a graded case only while Quest's bound misses a passkey there that dense finds (if it
    stops missing, tighten the budget: a case every method passes says nothing about the sketch or the cascade)."""
    tight = [r for r in results if "topk@tight" in r["answers"] and r["answers"]["dense"] == r["key"]]
    if tight:
        assert any(r["answers"]["topk@tight"] != r["key"] for r in tight), tight
