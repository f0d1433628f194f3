"""GPU check of the engine side: `python -m engine_adapter.gpu_check [--tokens 32768] [--layers 4]`.

1. A random-weight llama3-8b geometry (fp16, a few layers): chunked prefill of a long
   context, then decode steps in every mode; top-K with a budget covering the context
   must give dense's logits, every mode finite logits; timings printed.
2. SmolLM2-135M (if its package is installed): kvtier dense generation on the GPU equals
   HF's own greedy generation on the GPU.
Exits non-zero when a check fails. Timing here is a smoke signal, not a benchmark.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from engine_adapter.llama import Decoder
from engine_adapter.weights import load_hf, llama_from_hf, random_llama
from kvstore import Config, KVStore, ModelSpec


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def check_random(tokens: int, layers: int) -> bool:
    spec = ModelSpec.preset("llama3-8b", num_layers=layers)
    model = random_llama(spec, seed=0, dtype=torch.float16, device="cuda")
    config = Config(model=spec, hot_tokens=4096, warm_tokens=16384, gpu_bytes=8 << 30, cpu_bytes=16 << 30,
                    device="cuda")
    ids = torch.randint(0, model.args.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    ok = True
    with KVStore(config) as store:
        decoder = Decoder(model, store)
        base = store.create_sequence()
        _, prefill_s = timed(lambda: decoder.prefill(base, ids, chunk_tokens=2048))
        blocks = {name: tier["blocks"] for name, tier in store.stats()["tiers"].items()}
        print(f"random llama3-8b x{layers} layers: prefill {tokens:,} tokens {prefill_s:.1f} s "
              f"({tokens / prefill_s:,.0f} tok/s); blocks per tier {blocks}")
        logits = {}
        for mode, budget in (("dense", 4096), ("topk", 4 * tokens), ("topk", 2048), ("window", 2048), ("h2o", 2048)):
            seq = decoder.fork(base)
            steps, step_s = timed(lambda: [decoder.decode_step(seq, 7 + i, mode, budget) for i in range(8)])
            logits[mode, budget] = torch.stack(steps)
            ok &= bool(torch.isfinite(logits[mode, budget]).all())
            print(f"  {mode:>6} budget {budget:>7}: {step_s / 8 * 1e3:.1f} ms/step")
            decoder.free(seq)
        err = (logits["topk", 4 * tokens] - logits["dense", 4096]).abs().max().item()
        print(f"  full-budget topk vs dense max |dlogit| = {err:.2e}")
        ok &= err < 1e-2
        store.check_integrity()
    return ok


def check_smollm2(num_prompt: int = 2000, num_new: int = 16) -> bool:
    try:
        hf_model, tokenizer = load_hf("smollm2-135m")
    except FileNotFoundError as exc:
        print(f"smollm2 skipped: {exc}")
        return True
    hf_model = hf_model.cuda()
    text = " ".join(f"Line {i}: the lighthouse keeper wrote the weather in her log." for i in range(400))
    ids = tokenizer(text)["input_ids"][:num_prompt]
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=num_new,
                                min_new_tokens=num_new, do_sample=False)[0, num_prompt:].tolist()
    config = Config(model=ModelSpec.preset("smollm2-135m"), gpu_bytes=1 << 30, cpu_bytes=1 << 30, device="cuda")
    with KVStore(config) as store:
        decoder = Decoder(llama_from_hf(hf_model), store)
        ours = decoder.generate(store.create_sequence(), ids, num_new)
    print(f"smollm2 on cuda: kvtier dense {'==' if ours == ref else '!='} HF greedy ({tokenizer.decode(ours)!r})")
    return ours == ref


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    ok = check_random(args.tokens, args.layers)
    ok &= check_smollm2()
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
