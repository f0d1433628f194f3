"""The compact decoder with SmolLM2-135M's real weights: token for token what HF generates."""

from __future__ import annotations

import torch

from engine_adapter.decoder import Decoder
from kvstore import Config, KVStore, ModelSpec
from tests.engine_adapter import smollm2

NUM_PROMPT, NUM_NEW = 2000, 16


def dense_config() -> Config:
    return Config(model=ModelSpec.preset("smollm2-135m"), block_tokens=32, sink_tokens=64, hot_tokens=4096,
                  warm_tokens=32768, gpu_bytes=512 << 20, cpu_bytes=64 << 20, device="cpu")


def test_dense_mode_reproduces_hf_greedy_generation_on_2k_prose() -> None:
    _, tokenizer, model = smollm2.smollm2()
    prompt = smollm2.prose_ids()[:NUM_PROMPT]
    expected, hf_logits = smollm2.hf_greedy(NUM_PROMPT, NUM_NEW)
    with KVStore(dense_config()) as store:
        decoder = Decoder(model, store)
        seq = store.create_sequence()
        logits = decoder.prefill(seq, prompt, chunk_tokens=512)
        tokens = decoder.continue_greedy(seq, logits, NUM_NEW, mode="dense", budget=4096)
        assert decoder.length(seq) == NUM_PROMPT + NUM_NEW - 1
        store.check_integrity()
    # K/V rounded to fp16 is the only difference from HF's fp32 cache
    assert (logits - hf_logits).abs().max() < 0.05 * hf_logits.abs().max()
    assert tuple(tokens) == expected, f"ours {tokenizer.decode(tokens)!r} vs HF {tokenizer.decode(expected)!r}"
