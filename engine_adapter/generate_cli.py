"""`kvtier generate`: greedy decoding with kvtier holding the KV cache, then per-tier usage.

    kvtier generate --model smollm2-135m --prompt-file F --mode topk --budget 512 --max-new-tokens 16
    kvtier generate --engine hf --model smollm2-135m --prompt-file F --mode topk --budget 512

--engine kvtier (the default) runs kvtier's compact decoder; --engine hf runs transformers' own
generate() on the unmodified HF model with KVTierCache and kvtier attention (engine_adapter/hf_cache.py)
and reports the K/V bytes read per decode step.
--model is a packaged real model (smollm2-135m, loaded offline from its pip package)
or any ModelSpec preset (llama3-8b, ...) with seeded random weights and no tokenizer
(--random-weights forces that for a packaged model's geometry too):
the prompt's UTF-8 bytes are the token ids and the output is printed as ids.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from engine_adapter.decoder import Decoder
from engine_adapter.weights import PACKAGED_MODELS, load_model
from kvstore.config import Config, ModelSpec
from kvstore.heap import frozen_heap
from kvstore.store import MODES
from kvstore.store import KVStore

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = sorted(PACKAGED_MODELS) + ModelSpec.presets()
    parser.add_argument("--engine", choices=["kvtier", "hf"], default="kvtier",
                        help="kvtier: the compact decoder; hf: transformers' generate() through KVTierCache")
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(set(names)),
                        help="packaged real model, or a preset geometry with random weights")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-file", type=Path, help="UTF-8 text file holding the prompt")
    prompt.add_argument("--prompt", help="the prompt text itself")
    parser.add_argument("--mode", choices=MODES, default="dense", help="decode attention mode")
    parser.add_argument("--budget", type=int, default=4096, help="tokens each sparse decode step attends")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--chunk-tokens", type=int, default=512, help="prefill chunk length")
    parser.add_argument("--num-layers", type=int, default=None, help="override a preset's layer count")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["auto", *_DTYPES], default="auto",
                        help="compute dtype (auto: float32 on cpu, float16 on cuda); K/V are always fp16")
    parser.add_argument("--hot-tokens", type=int, default=4096)
    parser.add_argument("--warm-tokens", type=int, default=32768)
    parser.add_argument("--gpu-mib", type=int, default=1024, help="hot + warm pool size")
    parser.add_argument("--cpu-mib", type=int, default=4096, help="cold host tier size")
    parser.add_argument("--random-weights", action="store_true",
                        help="seeded random weights even for a packaged model (its geometry, no files needed)")
    parser.add_argument("--seed", type=int, default=0, help="random-weight seed")


def _check(args: argparse.Namespace) -> None:
    for name in ("budget", "max_new_tokens", "chunk_tokens", "gpu_mib", "cpu_mib"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.num_layers is not None and args.model in PACKAGED_MODELS and not args.random_weights:
        raise SystemExit(f"--num-layers needs random weights; add --random-weights to use it with {args.model!r}")
    if args.engine == "hf" and (args.model not in PACKAGED_MODELS or args.random_weights):
        raise SystemExit(f"--engine hf runs a packaged model's real weights ({', '.join(sorted(PACKAGED_MODELS))}); "
                         f"got --model {args.model}{' --random-weights' if args.random_weights else ''}")


def _prompt_ids(args: argparse.Namespace, tokenizer, vocab_size: int) -> list[int]:
    text = args.prompt if args.prompt is not None else args.prompt_file.read_text(encoding="utf-8")
    ids = tokenizer(text)["input_ids"] if tokenizer is not None else [b % vocab_size for b in text.encode()]
    if not ids:
        raise SystemExit("the prompt is empty")
    return ids


def _print_usage(store: KVStore, prefill_s: float, decode_s: float, num_prompt: int, num_new: int) -> None:
    stats = store.stats()
    print(f"\n--- {num_prompt:,} prompt tokens, {num_new} generated; prefill {prefill_s:.2f} s "
          f"({num_prompt / prefill_s:,.0f} tok/s), decode {decode_s:.2f} s", file=sys.stderr)
    _print_tiers(stats)
    attend = stats.get("attend")
    if attend and attend.get("read_fraction") is not None:
        print(f"decode read {attend['read_fraction']:.1%} of the context per step", file=sys.stderr)


def _print_tiers(stats: dict) -> None:
    print(f"{'tier':<6}{'blocks':>10}{'MiB':>10}{'capacity MiB':>15}", file=sys.stderr)
    for name, t in stats["tiers"].items():
        print(f"{name:<6}{t['blocks']:>10,}{t['bytes'] / 2**20:>10.1f}{t['capacity_bytes'] / 2**20:>15.1f}",
              file=sys.stderr)


def _store_config(args: argparse.Namespace, spec: ModelSpec) -> Config:
    return Config(model=spec, hot_tokens=args.hot_tokens, warm_tokens=args.warm_tokens,
                  gpu_bytes=args.gpu_mib << 20, cpu_bytes=args.cpu_mib << 20, device=args.device)


def _run_hf(args: argparse.Namespace, dtype: torch.dtype) -> int:
    """transformers' generate() on the unmodified model, K/V in the store, decode through store.attend."""
    from engine_adapter.hf_attention import NAME, register
    from engine_adapter.hf_cache import KVTierCache
    from engine_adapter.weights import args_from_hf_config, load_hf

    register()
    hf_model, tokenizer = load_hf(args.model)
    hf_model = hf_model.to(args.device, dtype)
    hf_model.set_attn_implementation(NAME)
    prompt_ids = _prompt_ids(args, tokenizer, hf_model.config.vocab_size)
    spec = args_from_hf_config(hf_model.config).spec
    with KVStore(_store_config(args, spec)) as store, KVTierCache(store, args.mode, args.budget) as cache:
        start = time.perf_counter()
        with torch.no_grad():  # not inference_mode: the store's tables must stay writable
            out = hf_model.generate(torch.tensor([prompt_ids], device=args.device), past_key_values=cache,
                                    do_sample=False, max_new_tokens=args.max_new_tokens,
                                    prefill_chunk_size=args.chunk_tokens)
        elapsed = time.perf_counter() - start
        new_ids = out[0, len(prompt_ids):].tolist()
        print(tokenizer.decode(new_ids, skip_special_tokens=True))
        print(f"\n--- {len(prompt_ids):,} prompt tokens, {len(new_ids)} generated by transformers' generate() in "
              f"{elapsed:.2f} s; mode {args.mode}, budget {args.budget:,}", file=sys.stderr)
        _print_tiers(store.stats())
        print(cache.decode_reads(), file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    _check(args)
    dtype = _DTYPES.get(args.dtype) or (torch.float16 if args.device.startswith("cuda") else torch.float32)
    if args.engine == "hf":
        return _run_hf(args, dtype)
    overrides = {} if args.num_layers is None else {"num_layers": args.num_layers}
    model, tokenizer = load_model(args.model, dtype=dtype, device=args.device, seed=args.seed,
                                  random_weights=args.random_weights, **overrides)
    prompt_ids = _prompt_ids(args, tokenizer, model.args.vocab_size)
    config = _store_config(args, model.args.spec)
    eos = getattr(tokenizer, "eos_token_id", None)
    with KVStore(config) as store:
        decoder, seq = Decoder(model, store), store.create_sequence()
        with frozen_heap():  # model and store loaded: collections meanwhile skip them (kvstore/heap.py)
            start = time.perf_counter()
            logits = decoder.prefill(seq, prompt_ids, args.chunk_tokens)
            prefill_s, start = time.perf_counter() - start, time.perf_counter()
            out = decoder.continue_greedy(seq, logits, args.max_new_tokens, args.mode, args.budget, eos)
            decode_s = time.perf_counter() - start
        print(tokenizer.decode(out) if tokenizer is not None else " ".join(map(str, out)))
        _print_usage(store, prefill_s, decode_s, len(prompt_ids), len(out))
        decoder.free(seq)
    return 0
