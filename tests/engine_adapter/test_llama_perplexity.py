"""Warm blocks in every format cost little perplexity: SmolLM2-135M on original prose, a 1K-token window.

The window is prefilled one chunk per prefill call, so every chunk attends to the earlier tokens as the store
reads them back (a single prefill keeps the whole prompt's K/V in fp16 and would never see the warm format).
The hot window is 64 tokens (not the default 4,096, which would hold this whole text fp16), so >= 85% of
the blocks read back are quantized: the worst case for a warm format. Goals: int8 and fp8 within 0.05 of
fp16, int4 within 0.2 (BENCHMARKS.md, Warm formats)."""

from __future__ import annotations

import functools
import math

import pytest

from engine_adapter.decoder import Decoder
from engine_adapter.evaluate import read_back_nll
from kvstore import Config, KVStore, ModelSpec
from tests.engine_adapter import smollm2

WINDOW = 1024
CHUNK = 128
GOALS = {"int8": 0.05, "fp8": 0.05, "int4": 0.2}  # the most a warm format may add to fp16's perplexity


def config(hot_tokens: int, warm_format: str) -> Config:
    return Config(model=ModelSpec.preset("smollm2-135m"), block_tokens=32, sink_tokens=64, hot_tokens=hot_tokens,
                  warm_tokens=8192, warm_format=warm_format, gpu_bytes=256 << 20, cpu_bytes=64 << 20, device="cpu")


def read_back_perplexity(decoder: Decoder, seq: int, ids: list[int]) -> float:
    """exp(mean next-token NLL) of ids, prefilled CHUNK tokens per call: each chunk's earlier tokens come from
    the store's read-back (with a 64-token hot window, almost all of them from warm blocks)."""
    return math.exp(float(read_back_nll(decoder, seq, ids, CHUNK).mean()))


@functools.cache
def window_perplexities(hot_tokens: int, warm_format: str = "int8") -> tuple[list[float], list[dict]]:
    """Perplexity of the window and the store's tier stats while it held it."""
    _, _, model = smollm2.smollm2()
    ids = list(smollm2.prose_ids())[:WINDOW]
    with KVStore(config(hot_tokens, warm_format)) as store:
        decoder = Decoder(model, store)
        seq = store.create_sequence()
        value = read_back_perplexity(decoder, seq, ids)
        stats = store.stats()["tiers"]
        decoder.free(seq)
    return [value], [stats]


@pytest.mark.parametrize("warm_format", sorted(GOALS))
def test_warm_format_perplexity_within_its_goal(warm_format: str) -> None:
    fp16, fp16_tiers = window_perplexities(hot_tokens=WINDOW)
    quant, quant_tiers = window_perplexities(64, warm_format)
    print(f"\nperplexity per {WINDOW}-token window: fp16 {fp16}, warm {warm_format} {quant}")
    for a, b, ref, held in zip(fp16, quant, fp16_tiers, quant_tiers):
        assert ref["warm"]["blocks"] == 0  # the reference really is all fp16
        assert held["warm"]["blocks"] >= 0.85 * (held["warm"]["blocks"] + held["hot"]["blocks"])  # >= 85% warm
        assert 1.0 < a < 50.0, f"fp16 perplexity {a:.2f}: the model is not reading the prose"
        assert abs(b - a) <= GOALS[warm_format], f"{warm_format} {b:.4f} vs fp16 {a:.4f}"
