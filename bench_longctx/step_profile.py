"""Where a captured decode token's GPU time goes, kernel by kernel (CUDA only); with --eager, where the eager
path's host time goes (Decoder(graphs=False): store.append + store.attend per layer, as an eager engine runs).

    python -m bench_longctx.step_profile --out DIR [--context 1048576] [--mode topk] [--steps 16] [--eager]
    python -m bench_longctx.step_profile --out DIR --batch 12 --context 131072 [--steps 16]

The e2e benchmark's model and store (llama3-8b geometry, random weights, random K/V fill, every
token appended): a few tokens to compile and capture, `steps` timed tokens through
Decoder.decode_step (one synced token at a time), two blocks' worth through Decoder.continue_greedy
(queued ahead of the host; the lines where it still synchronizes are listed), then `steps` tokens
under torch.profiler. Kernels are grouped by name and
reported per token: launches, microseconds, share of the token's GPU time. Launch-bound steps show
up as many short kernels whose count, not their bytes, sets the time. --eager adds the host side: the
functions of largest cumulative time per token (cProfile) and the Triton launches per token.
--batch B profiles the batched step instead: `kvtier bench serve`'s kvtier store holding B sequences of
--context tokens, one Decoder.decode_batch per step (the rows the Scheduler decodes in); its kernels per
step, then every step's wall time over two blocks' worth of steps, split into the steps where the sequences
open new tail blocks (a block boundary: they cross it together here) and the rest.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dataclasses
import pstats
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from bench_longctx.e2e_setup import e2e_store, fill_random, model_args, random_model
from bench_longctx.presets import get_preset
from bench_longctx.serve_bench import fill_random as fill_serve
from bench_longctx.serve_bench import serve_store, trace
from bench_longctx.timing import environment, timed, write_json
from engine_adapter.decoder import Decoder


def kernel_table(prof, steps: int) -> list[dict]:
    """Per kernel name: launches and GPU microseconds per token, largest first."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            row = totals[event.name[:90]]
            row[0] += 1
            row[1] += event.device_time
    gpu_us = sum(us for _, us in totals.values())
    rows = [{"kernel": name, "launches_per_token": n / steps, "us_per_token": us / steps, "share": us / gpu_us}
            for name, (n, us) in totals.items()]
    return sorted(rows, key=lambda r: -r["us_per_token"])


def host_syncs(run) -> dict[str, int]:
    """Where `run` synchronizes the host with the GPU (torch's sync debug mode): 'file:line' -> count."""
    found: collections.Counter = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        found[f"{w.filename}:{w.lineno}"] += 1
    return dict(found)


def host_table(run, steps: int, limit: int = 25) -> tuple[list[dict], float]:
    """`run` under cProfile: (the `limit` functions of largest cumulative host time, with their calls and ms per
    token; Triton launches per token)."""
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, tottime, cumtime, callers)
    rows = [{"function": f"{'/'.join(file.split('/')[-2:])}:{line}({name})", "calls_per_token": calls / steps,
             "ms_per_token": 1e3 * cum / steps,
             "self_ms_per_token": 1e3 * own / steps}
            for (file, line, name), (_, calls, own, cum, _) in stats.items()]
    launches = sum(calls for (file, _, name), (_, calls, *_) in stats.items()
                   if file.endswith("triton/runtime/jit.py") and name == "run")
    return sorted(rows, key=lambda r: -r["ms_per_token"])[:limit], launches / steps


def profile_batch(args) -> dict:
    """The batched step of `args.batch` sequences of `args.context` tokens: kernels per step, step wall times."""
    device = torch.device(args.device)
    p = dataclasses.replace(get_preset("h200").serve, requests=args.batch, contexts=(args.context,),
                            geometry=args.geometry, layers=args.layers)
    model = random_model(model_args(p.geometry, p.layers), device, torch.float16)
    store = serve_store("kvtier", p, model.args.spec, device, trace(p, args.batch, p.contexts))
    decoder = Decoder(model, store)
    seqs = [store.create_sequence() for _ in range(args.batch)]
    for seq in seqs:
        fill_serve(store, seq, args.context)
    tokens = [1] * args.batch

    def run(n: int) -> list[float]:
        took = []
        for _ in range(n):
            began = time.perf_counter()
            tokens[:] = decoder.decode_batch(seqs, tokens, args.mode, p.budget).argmax(-1).tolist()
            took.append(time.perf_counter() - began)
        return took

    run(4)  # compile, capture
    _, seconds = timed(lambda: run(args.steps), device)
    walk = 2 * p.block_tokens
    opening = [(decoder.length(seqs[0]) + i) % p.block_tokens == 0 for i in range(walk)]
    took = run(walk)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        run(args.steps)
        if device.type == "cuda":
            torch.cuda.synchronize()
    rows = kernel_table(prof, args.steps)
    other = sorted(t for t, o in zip(took, opening) if not o)
    result = {"path": f"batch{args.batch}", "environment": environment(device), "context": args.context,
              "batch": args.batch, "mode": args.mode, "budget": p.budget, "block_tokens": p.block_tokens,
              "layers": model.args.num_layers, "steps": args.steps,
              "ms_per_token_unprofiled": 1e3 * seconds / args.steps,
              "step_ms": [1e3 * t for t in took], "step_opens_tails": opening,
              "boundary_step_ms": [1e3 * t for t, o in zip(took, opening) if o],
              "other_step_ms_p50": 1e3 * other[len(other) // 2], "other_step_ms_max": 1e3 * other[-1],
              "gpu_us_per_token": sum(r["us_per_token"] for r in rows),
              "launches_per_token": sum(r["launches_per_token"] for r in rows), "kernels": rows}
    store.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=1 << 20)
    parser.add_argument("--mode", default="topk", choices=("topk", "dense", "sketch"))
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--eager", action="store_true", help="the eager path (no graphs), with its host profile")
    parser.add_argument("--batch", type=int, default=0, help="profile the batched step of this many sequences")
    parser.add_argument("--geometry", default="llama3-8b", help="--batch: the model geometry")
    parser.add_argument("--layers", type=int, default=0, help="--batch: layers (0: the geometry's)")
    parser.add_argument("--device", default="cuda", help="--batch: cpu checks the script, it times nothing useful")
    args = parser.parse_args(argv)
    if args.batch:
        result = profile_batch(args)
        write_json(args.out, f"step_profile_{result['path']}_{args.mode}_{args.context}.json", result)
        print(f"{args.batch} x {args.context} {args.mode}: {result['ms_per_token_unprofiled']:.2f} ms/step wall, "
              f"{result['gpu_us_per_token'] / 1e3:.2f} ms GPU, {result['launches_per_token']:.0f} launches/step; "
              f"steps opening tails: {', '.join(f'{t:.1f}' for t in result['boundary_step_ms'])} ms; other "
              f"p50 {result['other_step_ms_p50']:.2f} max {result['other_step_ms_max']:.2f} ms")
        for r in result["kernels"][:25]:
            print(f"{r['us_per_token']:9.1f} us {r['launches_per_token']:6.1f}x {100 * r['share']:5.1f}%  "
                  f"{r['kernel']}")
        return 0
    device = torch.device("cuda")
    p = dataclasses.replace(get_preset("h200").e2e, context=args.context, steps=3 * args.steps + 8, modes=args.mode)
    model = random_model(model_args(p.geometry, p.layers), device, torch.float16)
    store = e2e_store(model.args.spec, p, device)
    decoder = Decoder(model, store, graphs=not args.eager)
    seq = store.create_sequence()
    fill_random(store, seq, p.context, seed=0, progress=lambda it, _: it)
    token = [1]

    def run(n: int) -> None:
        for _ in range(n):
            token[0] = int(decoder.decode_step(seq, token[0], args.mode, p.budget).argmax())

    run(4)  # compile, capture
    _, seconds = timed(lambda: run(args.steps), device)
    logits = decoder.decode_step(seq, token[0], args.mode, p.budget)
    ahead = 2 * p.block_tokens  # crosses block boundaries: their host work overlaps the queued tokens
    _, ahead_s = timed(lambda: decoder.continue_greedy(seq, logits, ahead + 1, args.mode, p.budget), device)
    syncs = host_syncs(lambda: decoder.continue_greedy(seq, logits, ahead + 1, args.mode, p.budget))
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        run(args.steps)
        torch.cuda.synchronize()
    rows = kernel_table(prof, args.steps)
    host, triton_launches = host_table(lambda: run(args.steps), args.steps) if args.eager else ([], None)
    result = {"path": "eager" if args.eager else "graph", "environment": environment(device), "context": p.context,
              "mode": args.mode, "budget": p.budget,
              "block_tokens": p.block_tokens, "layers": model.args.num_layers, "steps": args.steps,
              "ms_per_token_unprofiled": 1e3 * seconds / args.steps,
              "ms_per_token_run_ahead": 1e3 * ahead_s / ahead, "run_ahead_tokens": ahead,
              "host_syncs_in_run_ahead": syncs,
              "gpu_us_per_token": sum(r["us_per_token"] for r in rows),
              "launches_per_token": sum(r["launches_per_token"] for r in rows), "kernels": rows,
              "triton_launches_per_token": triton_launches, "host_functions": host}
    store.close()
    write_json(args.out, f"step_profile_{result['path']}_{args.mode}_{p.context}.json", result)
    print(f"{args.mode} at {p.context}: {result['ms_per_token_unprofiled']:.2f} ms/token wall, "
          f"{result['gpu_us_per_token'] / 1e3:.2f} ms GPU, {result['launches_per_token']:.0f} launches/token")
    print(f"continue_greedy (run ahead, {ahead} tokens over block boundaries): "
          f"{result['ms_per_token_run_ahead']:.2f} ms/token; host syncs: {syncs or 'none but the last'}")
    for r in rows[:25]:
        print(f"{r['us_per_token']:9.1f} us {r['launches_per_token']:6.1f}x {100 * r['share']:5.1f}%  {r['kernel']}")
    if args.eager:
        print(f"host, per token under cProfile ({triton_launches:.0f} Triton launches): cumulative / own ms, calls")
        for r in host:
            print(f"{r['ms_per_token']:8.2f} {r['self_ms_per_token']:7.2f} {r['calls_per_token']:7.1f}  "
                  f"{r['function']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
