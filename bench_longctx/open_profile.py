"""Where store.open's time goes on the host, in two regimes, each saved once into --dir:

    python -m bench_longctx.open_profile --regime blocks --dir DIR [--profile 25] [--out FILE]
    python -m bench_longctx.open_profile --regime bytes --dir DIR

  blocks  per-block overhead: 32 layers, 1 kv head, head_dim 16, 256K tokens (262,144 blocks of 32
          tokens, 128 B of summary each): seconds per 1M blocks
  bytes   byte throughput: llama3-8b geometry (8 kv heads, head_dim 128), 8 layers, 128K tokens
          (32,768 blocks, 4 KiB of summary each): MB/s of what open reads
The context is filled with the contexts benchmarks' random K/V (contexts_store.py) and saved once (the
directory is reused when it holds one); each open runs in a fresh store (a new process's view; the page cache stays
warm) --repeat times, the best reported (wall and CPU seconds); --profile N prints cProfile's top N functions of one more.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

import torch

from bench_longctx.contexts_store import bench_config, counting_reads, fill
from bench_longctx.timing import environment, timed
from kvstore.config import Config, ModelSpec
from kvstore.store import KVStore

REGIMES = {
    "blocks": dict(geometry="smollm2-135m", layers=32, tokens=256 << 10, kv_heads=1, head_dim=16),
    "bytes": dict(geometry="llama3-8b", layers=8, tokens=128 << 10, kv_heads=8, head_dim=128),
}


def regime_args(regime: str, directory: str) -> argparse.Namespace:
    r = REGIMES[regime]
    return argparse.Namespace(device="cpu", gpu_bytes=64 << 20, warm_tokens=2048,
                              cpu_bytes=64 << 20, ssd_bytes=32 << 30, path=str(Path(directory) / regime), **r)


def config(args: argparse.Namespace) -> Config:
    spec = ModelSpec(num_layers=args.layers, num_q_heads=args.kv_heads, num_kv_heads=args.kv_heads,
                     head_dim=args.head_dim)
    return bench_config(args, args.path).replace(model=spec)


def saved(args: argparse.Namespace) -> None:
    """Fill and save the regime's context unless args.path holds it already."""
    with KVStore(config(args)) as store:
        if "bench" in store.saved_contexts():
            return
        (seq, _), fill_s = timed(lambda: fill(store, args.tokens))
        _, save_s = timed(lambda: store.save(seq, "bench"))
    print(f"filled {args.tokens} tokens in {fill_s:.1f} s, saved in {save_s:.1f} s", flush=True)


def open_once(args: argparse.Namespace, profiler: cProfile.Profile | None = None) -> tuple[float, float, int]:
    """Wall and CPU seconds (this process, every thread: what a busy shared host changes least) of one
    store.open in a fresh store, and the bytes it read."""
    with KVStore(config(args)) as store:
        reads = counting_reads(store)
        if profiler is not None:
            profiler.enable()
        cpu = time.process_time()
        _, seconds = timed(lambda: store.open("bench"))
        cpu = time.process_time() - cpu
        if profiler is not None:
            profiler.disable()
        return seconds, cpu, sum(reads)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regime", choices=sorted(REGIMES), default="blocks")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", type=int, default=0)
    parser.add_argument("--out", default=None)
    a = parser.parse_args(argv)
    args = regime_args(a.regime, a.dir)
    saved(args)
    runs = [open_once(args) for _ in range(a.repeat)]
    seconds, cpu, read = min(runs)
    blocks = args.layers * -(-args.tokens // 32)
    result = {"regime": a.regime, "blocks": blocks, "open_s": seconds, "open_cpu_s": min(r[1] for r in runs),
              "read_bytes": read, "s_per_1M_blocks": seconds * 1e6 / blocks, "MB_per_s": read / seconds / 1e6}
    print(json.dumps(result))
    if a.profile:
        profiler = cProfile.Profile()
        open_once(args, profiler)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(a.profile)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(a.profile)
    if a.out:
        Path(a.out).write_text(json.dumps({**result, "environment": environment(torch.device("cpu"))}, indent=1))


if __name__ == "__main__":
    main()
