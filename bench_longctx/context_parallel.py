"""`python -m bench_longctx.context_parallel`: greedy decode of one sequence sharded over N ranks, against one
process holding the whole sequence, in the same run.

Both sides: the geometry's Llama with random weights (the same seed, replicated on every rank), a context of
random K/V (the same values on both sides: each rank keeps its ShardPlan range of one seeded stream), every
block fp16 in the hot tier, `steps` greedy tokens after two warm-up tokens, every token appended.
  context parallel   ContextParallelDecoder on N spawned ranks (NCCL when each rank has a GPU of its own,
                     else gloo, which stages the [Hq, D + 1] exchange through host memory: ranks sharing a GPU)
  one process        Decoder on the whole sequence: the eager path (store.append + store.attend per layer, the
                     path the ranks run) and, on CUDA, the captured step (the single-GPU number to beat)
Reports tokens/s of each and whether the ranks' greedy tokens equal the one-process eager tokens (dense: they
must; topk / sketch: the ranks together attend a superset of one process's top-K, so they may differ).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench_longctx.e2e_setup import model_args, random_model
from bench_longctx.models import model_store
from bench_longctx.timing import sync
from engine_adapter.context_parallel import ContextParallelDecoder
from engine_adapter.decoder import Decoder
from kvstore.parallel.group import RankGroup, rank_device, spawn
from kvstore.parallel.sequence import ShardedSequence
from kvstore.parallel.shards import ShardPlan

CHUNK = 1 << 15  # tokens of random K/V drawn at a time
WARMUP = 2


def make_store(p: argparse.Namespace, device: torch.device, tokens: int):
    """Every block of `tokens` (and the decoded ones) fp16 in the hot tier."""
    spec = model_args(p.geometry, p.layers).spec
    hot = tokens + p.steps + WARMUP + 2 * p.block_tokens
    return model_store(spec, device, hot_tokens=hot, warm_tokens=0, sink_tokens=64, recent_tokens=1024,
                       sequences=1, staging_tokens=1024, block_tokens=p.block_tokens, cpu_bytes=64 << 20)


def random_kv(p: argparse.Namespace, device: torch.device):
    """(layer, k, v) chunks [n, H, D] fp16 of the context, the same stream on every rank and process."""
    spec = model_args(p.geometry, p.layers).spec
    g = torch.Generator(device=device).manual_seed(p.seed)
    for layer in range(spec.num_layers):
        for start in range(0, p.context, CHUNK):
            n = min(CHUNK, p.context - start)
            k = torch.randn((n, spec.num_kv_heads, spec.head_dim), device=device, generator=g)  # [n, H, D]
            k[..., :8] *= 6  # outlier channels, as real keys have
            yield layer, k.half(), torch.randn(k.shape, device=device, generator=g).half()


def timed_greedy(step, device: torch.device, steps: int) -> dict:
    """WARMUP untimed greedy tokens from token 1, then `steps` timed ones."""
    tokens = [1]
    for _ in range(WARMUP):
        tokens.append(int(step(tokens[-1]).argmax()))
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        tokens.append(int(step(tokens[-1]).argmax()))
    sync(device)
    seconds = time.perf_counter() - start
    return {"tokens_per_s": steps / seconds, "ms_per_token": 1e3 * seconds / steps, "tokens": tokens[1:]}


def rank_run(group: RankGroup, p: argparse.Namespace) -> dict:
    device = rank_device(group.rank, p.device)
    model = random_model(model_args(p.geometry, p.layers), device, torch.float16, seed=p.seed)
    plan = ShardPlan.split(p.context, group.world_size, p.block_tokens)
    lo, hi = plan.token_range(group.rank)
    with make_store(p, device, int(min(hi, p.context) - lo)) as store:
        sequence = ShardedSequence(store, group, plan)
        for layer, k, v in random_kv(p, device):
            sequence.fill(layer, k, v)
        decoder = ContextParallelDecoder(model, store, group)
        decoder.use(sequence)
        result = timed_greedy(lambda t: decoder.decode_step(t, p.mode, p.budget), device, p.steps)
        return result | {"rank": group.rank, "device": str(device), "tokens_held": int(min(hi, p.context) - lo)}


def one_process_run(group: RankGroup, p: argparse.Namespace) -> dict:
    device = rank_device(0, p.device)
    model = random_model(model_args(p.geometry, p.layers), device, torch.float16, seed=p.seed)
    out = {}
    for graphs in ([False, True] if device.type == "cuda" else [False]):
        with make_store(p, device, p.context) as store:
            seq = store.create_sequence()
            for layer, k, v in random_kv(p, device):
                store.append(seq, layer, k, v)
            decoder = Decoder(model, store, graphs=graphs)
            result = timed_greedy(lambda t: decoder.decode_step(seq, t, p.mode, p.budget), device, p.steps)
            out["captured" if graphs else "eager"] = result
    return out


def run(p: argparse.Namespace) -> dict:
    backend = p.backend
    if backend == "auto":
        backend = "nccl" if p.device == "cuda" and torch.cuda.device_count() >= p.ranks else "gloo"
    ranks = spawn(rank_run, p.ranks, backend, p)
    single = spawn(one_process_run, 1, "gloo", p)[0]
    return {"args": vars(p), "backend": backend, "ranks": ranks, "one_process": single,
            "same_tokens": ranks[0]["tokens"] == single["eager"]["tokens"],
            "ranks_agree": all(r["tokens"] == ranks[0]["tokens"] for r in ranks)}


def summary(result: dict) -> str:
    r0, single = result["ranks"][0], result["one_process"]
    a = result["args"]
    lines = [f"{a['geometry']} context {a['context']} mode {a['mode']} budget {a['budget']}, {a['device']}, "
             f"{a['ranks']} ranks over {result['backend']} on {sorted({r['device'] for r in result['ranks']})}",
             f"  context parallel ({a['ranks']} ranks): {r0['tokens_per_s']:.2f} tok/s",
             f"  one process, eager:         {single['eager']['tokens_per_s']:.2f} tok/s"]
    if "captured" in single:
        lines.append(f"  one process, captured:      {single['captured']['tokens_per_s']:.2f} tok/s")
    lines.append(f"  same greedy tokens as one process (eager): {result['same_tokens']}; ranks agree: "
                 f"{result['ranks_agree']}")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench_longctx.context_parallel", description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--context", type=int, default=131072, help="tokens of random K/V before decoding")
    ap.add_argument("--mode", choices=("dense", "topk", "sketch"), default="topk")
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=32, help="timed greedy tokens")
    ap.add_argument("--geometry", default="llama3-8b", choices=("llama3-8b", "llama3-70b", "qwen2.5-7b", "smollm2-135m"))
    ap.add_argument("--layers", type=int, default=0, help="override the geometry's layer count (0: keep)")
    ap.add_argument("--block-tokens", type=int, default=32)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                    help="auto: nccl when every rank has a GPU of its own, else gloo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    p = ap.parse_args(argv)
    if p.ranks < 1 or p.context < p.ranks * p.block_tokens or p.steps < 1:
        ap.error(f"need ranks >= 1, steps >= 1 and context >= ranks * block_tokens, got {p.ranks}, {p.steps}, "
                 f"{p.context}")
    return p


def main(argv: list[str] | None = None) -> dict:
    p = parse(argv)
    result = run(p)
    print(summary(result))
    if p.out:
        with open(p.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
