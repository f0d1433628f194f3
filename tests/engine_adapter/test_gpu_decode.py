"""The engine on a GPU (marked `cuda`: skipped without one; bench_longctx/h200_run.sh runs them).

A random-weight llama3-8b geometry (fp16, 4 layers) prefills a 32K-token context in chunks and
then decodes in every mode: every mode gives finite logits, and top-K with a budget covering the
whole context gives dense's logits. SmolLM2-135M (when installed): kvtier's dense generation on
the GPU equals HF's own greedy generation on the GPU. Speed is measured in bench_longctx, not here.
"""

from __future__ import annotations

import copy

import pytest
import torch

from engine_adapter.decoder import Decoder
from engine_adapter.weights import llama_from_hf, random_llama
from kvstore import Config, KVStore, ModelSpec
from tests.engine_adapter import smollm2

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
NUM_TOKENS, NUM_LAYERS, NUM_STEPS = 32768, 4, 8
FULL_BUDGET = 4 * NUM_TOKENS  # more than the context: top-K keeps every block
NUM_PROMPT, NUM_NEW = 2000, 16


@pytest.fixture(scope="module")
def prefilled():
    """(decoder, seq): a random 32K-token context, longer than hot + warm tokens; tests decode on forks of it."""
    spec = ModelSpec.preset("llama3-8b", num_layers=NUM_LAYERS)
    model = random_llama(spec, seed=0, dtype=torch.float16, device=DEVICE)
    config = Config(model=spec, hot_tokens=4096, warm_tokens=16384, gpu_bytes=8 << 30, cpu_bytes=16 << 30,
                    device=DEVICE)
    ids = torch.randint(0, model.args.vocab_size, (NUM_TOKENS,), generator=torch.Generator().manual_seed(0))
    with KVStore(config) as store:
        decoder = Decoder(model, store)
        seq = store.create_sequence()
        decoder.prefill(seq, ids, chunk_tokens=2048)
        yield decoder, seq


def decode_logits(decoder: Decoder, base: int, mode: str, budget: int) -> torch.Tensor:
    """fp32 logits [NUM_STEPS, vocab] of NUM_STEPS decode steps on a fork of the prefilled sequence."""
    seq = decoder.fork(base)
    logits = torch.stack([decoder.decode_step(seq, 7 + i, mode, budget) for i in range(NUM_STEPS)])
    decoder.free(seq)
    decoder.store.check_integrity()
    return logits


@pytest.mark.parametrize("mode, budget", [("dense", 4096), ("topk", 2048), ("window", 2048), ("h2o", 2048)])
def test_every_mode_decodes_finite_logits_over_a_32k_context(prefilled, mode: str, budget: int) -> None:
    decoder, base = prefilled
    assert torch.isfinite(decode_logits(decoder, base, mode, budget)).all()


def test_topk_with_a_budget_covering_the_context_gives_dense_logits(prefilled) -> None:
    decoder, base = prefilled
    dense = decode_logits(decoder, base, "dense", 4096)
    topk = decode_logits(decoder, base, "topk", FULL_BUDGET)
    assert torch.isfinite(topk).all()
    assert (topk - dense).abs().max().item() < 1e-2


def test_smollm2_dense_generation_equals_hf_greedy_on_the_gpu() -> None:
    hf_cpu, tokenizer, _ = smollm2.smollm2()  # skips when the model is not installed
    hf_model = copy.deepcopy(hf_cpu).to(DEVICE)  # the shared model stays on the CPU for the other tests
    ids = list(smollm2.prose_ids()[:NUM_PROMPT])
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([ids], device=DEVICE), max_new_tokens=NUM_NEW,
                                     min_new_tokens=NUM_NEW, do_sample=False)[0, NUM_PROMPT:].tolist()
    config = Config(model=ModelSpec.preset("smollm2-135m"), gpu_bytes=1 << 30, cpu_bytes=1 << 30, device=DEVICE)
    with KVStore(config) as store:
        decoder = Decoder(llama_from_hf(hf_model), store)
        ours = decoder.generate(store.create_sequence(), ids, NUM_NEW)
        store.check_integrity()
    assert ours == expected, f"ours {tokenizer.decode(ours)!r} vs HF {tokenizer.decode(expected)!r}"
