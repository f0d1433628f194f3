"""Warm int8 blocks cost almost no perplexity: SmolLM2-135M on original prose, 2K-token windows."""

from __future__ import annotations

from engine_adapter.evaluate import perplexity
from engine_adapter.decoder import Decoder
from kvstore import Config, KVStore, ModelSpec
from tests.engine_adapter import smollm2

WINDOW = 2048


def config(hot_tokens: int) -> Config:
    return Config(model=ModelSpec.preset("smollm2-135m"), block_tokens=32, sink_tokens=64, hot_tokens=hot_tokens,
                  warm_tokens=8192, gpu_bytes=256 << 20, cpu_bytes=64 << 20, device="cpu")


def window_perplexities(hot_tokens: int) -> tuple[list[float], list[dict]]:
    """Perplexity of each window and the store's tier stats while it held that window."""
    _, _, model = smollm2.smollm2()
    ids = list(smollm2.prose_ids())
    windows = [ids[:WINDOW], ids[-WINDOW:]]  # the text's start and end (they overlap a little)
    values, stats = [], []
    with KVStore(config(hot_tokens)) as store:
        decoder = Decoder(model, store)
        for window in windows:
            # prefill chunks attend to the store's read-back: with a 64-token hot window almost every
            # key and value a chunk sees beyond its last 64 tokens comes back from an int8 block
            seq = store.create_sequence()
            values.append(perplexity(decoder, window, chunk_tokens=256, seq=seq))
            stats.append(store.stats()["tiers"])
            decoder.free(seq)
    return values, stats


def test_warm_int8_perplexity_within_0_05_of_fp16() -> None:
    fp16, fp16_tiers = window_perplexities(hot_tokens=WINDOW)
    int8, int8_tiers = window_perplexities(hot_tokens=64)
    print(f"\nperplexity per {WINDOW}-token window: fp16 {fp16}, warm int8 {int8}")
    for a, b, ref, quant in zip(fp16, int8, fp16_tiers, int8_tiers):
        assert ref["warm"]["blocks"] == 0  # the reference really is all fp16
        assert quant["warm"]["blocks"] >= 0.9 * (quant["warm"]["blocks"] + quant["hot"]["blocks"])  # >= 90% int8
        assert 1.0 < a < 50.0, f"fp16 perplexity {a:.2f}: the model is not reading the prose"
        assert abs(b - a) <= 0.05, f"int8 {b:.4f} vs fp16 {a:.4f}"
