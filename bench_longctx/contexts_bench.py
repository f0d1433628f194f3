"""Contexts as objects: what fork shares and what opening a saved context costs.

    python -m bench_longctx.contexts_bench --preset cpu  [--out FILE]      # 2-core CPU, tiny geometry, ~1 min
    python -m bench_longctx.contexts_bench --preset h200 --open-tokens 1M [--out FILE]
    python -m bench_longctx.contexts_bench --preset h200 --open-tokens 512K --fork-tokens 0 --background
    python -m bench_longctx.contexts_bench --preset cpu --contexts '' --fork-tokens 0 --profile 25  # + its profile

Random K/V of a named geometry with token ids recorded, the store's windows (hot and warm on the
"GPU" pools, the rest in cpu int8 and ssd; --warm-tokens 1048576 --gpu-bytes 75161927680 keeps a 1M context
int8 on the GPU, so that a writer saving into /dev/shm does not also hold it in pinned host memory):
  contexts     per length: save seconds and bytes, then store.open in a fresh store on the same
               ssd_path: seconds, bytes read (summaries, H2O scores, token ids; sketch codes are not
               read until mode="sketch"), and the first attend per mode beside the never-saved one's
  new_process  a context of --open-tokens saved, then opened in a NEW process (python -m ... open)
               that decodes one token with a random-weight Llama of the geometry (topk, the
               default): seconds to open and to the first token, and its logits against the
               never-saved sequence's in the writer; twice: a cold process, then one that first ran a
               step over a throwaway sequence (kernels loaded, CUDA initialised: a serving process) and,
               after its first token, loads the whole context (store.load); each decodes 4 more tokens, as
               the writer does, and says which path each took (captured step or eager); --background adds a
               third that opens with store.open(name, background_load=True) and decodes from its first
               token until the load has ended (bench_longctx/contexts_tokens.py); the store has a staging
               row per selected block (staging_tokens = the budget), which the captured step needs to read
               cpu-tier blocks itself
  forks        10 sequences forked from one --fork-tokens prefix: blocks and bytes stored against
               the prefix alone (~1x: full blocks shared, one partial tail copied per fork); 0 skips it
  transfer     a context of --transfer-tokens saved, then loaded whole by a new store from a cold page cache:
               GB/s against the disk's write + fsync and read ceilings and the pinned H2D copy, measured in
               the same run (bench_longctx/contexts_transfer.py); 0 skips it, as --open-tokens 0 skips new_process

    python -m bench_longctx.contexts_bench --preset h200 --open-tokens 0 --fork-tokens 0 --transfer-tokens 512K
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_longctx.contexts_store import BLOCK_TOKENS, VOCAB, bench_config, counting_reads, fill, preset_defaults
from bench_longctx.contexts_tokens import BUDGET, decode_while_loading, describe, first_token, next_tokens
from bench_longctx.contexts_transfer import run_transfer, summary
from bench_longctx.presets import parse_tokens
from bench_longctx.timing import environment, timed
from engine_adapter.decoder import Decoder
from engine_adapter.weights import random_llama
from kvstore.store import KVStore

MODES = ("topk", "sketch", "dense")  # topk: min/max summaries (Quest); sketch: the 4-bit key sketch (eviction/)
PRESETS = {  # cpu: a small run on any machine (tests/bench_longctx runs a smaller one); h200 keeps 1M on a 235 GiB disk
    "cpu": dict(geometry="smollm2-135m", layers=4, contexts="8K,32K", open_tokens="32K", fork_tokens="32K",
                device="cpu", gpu_bytes=256 << 20, cpu_bytes=256 << 20, ssd_bytes=16 << 30, warm_tokens=2048,
                transfer_tokens="0"),
    "h200": dict(geometry="llama3-8b", layers=32, contexts="", open_tokens="1M", fork_tokens="128K",
                 device="cuda", gpu_bytes=16 << 30, cpu_bytes=48 << 30, ssd_bytes=96 << 30, warm_tokens=2048,
                 transfer_tokens="0"),
}


def first_attends(store: KVStore, seq: int) -> dict:
    q = torch.randn((store.spec.num_q_heads, store.spec.head_dim), generator=torch.Generator().manual_seed(1))
    q, out = q.half().to(store.device), {}
    for mode in MODES:
        before = store.stats()["attend"]["cold_blocks_fetched"]
        _, seconds = timed(lambda: [store.attend(seq, layer, q, mode, budget=2048)
                                    for layer in range(store.spec.num_layers)])
        out[mode] = {"s": seconds, "blocks_read": store.stats()["attend"]["cold_blocks_fetched"] - before}
    return out


def run_context(args: argparse.Namespace, context: int, directory: str) -> dict:
    path = str(Path(directory) / f"ctx-{context}")
    with KVStore(bench_config(args, path)) as store:
        seq, _ = fill(store, context)
        _, save_s = timed(lambda: store.save(seq, "bench"))
        never_saved = first_attends(store, seq)
    with KVStore(bench_config(args, path)) as store:  # what a new process does: nothing cached in the store
        reads = counting_reads(store)
        opened, open_s = timed(lambda: store.open("bench"))
        read_bytes = sum(reads)
        attends = first_attends(store, opened)  # sketch mode reads the codes now
        sketch_bytes = sum(reads) - read_bytes
    shutil.rmtree(path, ignore_errors=True)
    return {"context": context, "blocks_per_layer": -(-context // BLOCK_TOKENS), "save_s": save_s, "open_s": open_s,
            "open_read_bytes": read_bytes, "bytes_read_by_first_attends": sketch_bytes,
            "first_attend": attends, "first_attend_never_saved": never_saved}


def decoder(store: KVStore, args: argparse.Namespace) -> Decoder:
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    return Decoder(random_llama(store.spec, seed=0, vocab_size=VOCAB, dtype=dtype, device=args.device), store)


def warm_up(dec: Decoder, store: KVStore, args: argparse.Namespace) -> float:
    """Seconds of one topk step over a throwaway 4-block sequence: what a serving process pays once at start
    (kernels loaded from triton's cache, CUDA and cuBLAS initialised), before any context is opened."""
    def step() -> None:
        seq, _ = fill(store, 4 * BLOCK_TOKENS)
        dec.decode_step(seq, 0, "topk", BUDGET)
        store.free(seq)
    return timed(step, args.device)[1]


def write_and_save(args: argparse.Namespace, context: int, path: str) -> tuple[list[int], dict, torch.Tensor]:
    """The writer: fill, save, decoded tokens of the never-saved sequence: (token ids, timings, the first one's
    logits). Its store and model are gone when this returns."""
    with KVStore(bench_config(args, path)) as store:
        (seq, ids), fill_s = timed(lambda: fill(store, context))
        print(f"writer: {context} tokens filled in {fill_s:.1f} s", flush=True)
        _, save_s = timed(lambda: store.save(seq, "bench"))
        print(f"writer: saved in {save_s:.1f} s", flush=True)
        saved_bytes = sum(store.stats()["tiers"][t]["bytes"] for t in ("hot", "warm", "cpu", "ssd"))
        dec = decoder(store, args)
        want, writer_s = first_token(dec, seq, ids[-1] % VOCAB, args.device)
        after = next_tokens(dec, seq, want, args.device)
    print(f"writer: first token of the never-saved sequence in {writer_s:.2f} s, then "
          f"{', '.join(f'{t:.3f}' for t in after['next_tokens_s'])} s ({', '.join(after['next_tokens_path'])})",
          flush=True)
    return ids, {"fill_s": fill_s, "save_s": save_s, "stored_bytes_before_save": saved_bytes,
                 "writer_first_token_s": writer_s, "writer_next_tokens_s": after["next_tokens_s"],
                 "writer_next_tokens_path": after["next_tokens_path"]}, want


def run_new_process(args: argparse.Namespace, context: int, directory: str) -> dict:
    path, out = str(Path(directory) / "open"), Path(directory) / "child.json"
    ids, writer, want = write_and_save(args, context, path)
    if args.device == "cuda":  # the writer's cached allocations would leave the child too little of the GPU
        gc.collect()
        torch.cuda.empty_cache()
    argv = [sys.executable, "-m", "bench_longctx.contexts_bench", "open", "--path", path, "--out", str(out),
            "--last", str(ids[-1] % VOCAB), f"--profile={args.profile}"] + \
        [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
         ("geometry", "layers", "device", "gpu_bytes", "cpu_bytes", "ssd_bytes", "warm_tokens", "background_tokens")]
    children = {}
    runs = [("cold", []), ("warmed_up", ["--warm-up", "--load"])] + \
        ([("background", ["--warm-up", "--background"])] if args.background else [])
    for name, extra in runs:  # the later ones read a page cache the first warmed
        started = time.perf_counter()
        subprocess.run(argv + extra, check=True, cwd=Path(__file__).resolve().parents[1])
        child = json.loads(out.read_text())
        got = torch.tensor(child.pop("logits"))
        children[name] = {**child, "child_wall_s": time.perf_counter() - started,
                          "token_equal": int(got.argmax()) == int(want.argmax()),
                          "max_abs_logit_diff": float((got - want).abs().max())}
    shutil.rmtree(path, ignore_errors=True)
    return {"context": context, **writer, **children["cold"], "warmed_up_process": children["warmed_up"],
            "background_load_process": children.get("background")}


def open_in_this_process(args: argparse.Namespace) -> None:
    """The child of run_new_process: open, decode one token, write seconds and logits as JSON."""
    started = time.perf_counter()
    with KVStore(bench_config(args, args.path)) as store:
        init_s = time.perf_counter() - started
        dec, model_s = timed(lambda: decoder(store, args), args.device)
        warm_s = warm_up(dec, store, args) if args.warm_up else 0.0
        reads = counting_reads(store)
        seq, open_s = timed(lambda: store.open("bench", background_load=args.background), args.device)
        open_bytes = sum(reads)
        profiler, eager = cProfile.Profile() if args.profile else None, dec.paths["eager"]
        with profiler or contextlib.nullcontext():
            logits, token_s = first_token(dec, seq, args.last, args.device)
        if profiler is not None:
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
        fetched, first_path = store.stats()["attend"]["cold_blocks_fetched"], \
            "eager" if dec.paths["eager"] > eager else "captured"
        loaded, load_s = timed(lambda: store.load(seq), args.device) if args.load else (0, 0.0)
        if args.background:  # from the token after the first: until every block is in and tokens run captured
            after = {"background": decode_while_loading(dec, store, seq, logits, args.device, args.background_tokens)}
        else:
            after = next_tokens(dec, seq, logits, args.device)  # promotions of blocks fetched twice, then steady
        result = {"store_init_s": init_s, "model_init_s": model_s, "process_warm_up_s": warm_s, "open_s": open_s,
                  "open_read_bytes": open_bytes, "first_token_s": token_s, "open_to_first_token_s": open_s + token_s,
                  "blocks_read_for_first_token": fetched, "blocks_loaded_after_first_token": loaded,
                  "load_s": load_s, "first_token_path": first_path, **after,
                  "promotions_in_next_tokens": store.stats()["attend"]["promotions"],
                  "cold_blocks_fetched_in_all": store.stats()["attend"]["cold_blocks_fetched"],
                  "cold_slices_staged_by_captured_steps": store.stats()["attend"]["cold_slices_staged"],
                  "logits": logits.tolist()}
    Path(args.out).write_text(json.dumps(result))


def run_forks(args: argparse.Namespace, context: int, directory: str) -> dict:
    with KVStore(bench_config(args, str(Path(directory) / "forks"))) as store:
        seq, _ = fill(store, context)

        def held() -> dict:
            blocks = store.stats()["blocks"]
            return {**blocks, "bytes": sum(t["bytes"] for t in store.stats()["tiers"].values())}

        alone = held()
        forks = [store.fork(seq) for _ in range(10)]
        shared = held()
        store.check_integrity()
    return {"prefix_tokens": context, "forks": len(forks), "prefix_alone": alone, "with_10_forks": shared,
            "blocks_ratio": shared["stored"] / alone["stored"], "bytes_ratio": shared["bytes"] / alone["bytes"]}


def print_opened(opened: dict) -> None:
    print(f"new process, {opened['context']} tokens: open {opened['open_s']:.2f} s + first token "
          f"{opened['first_token_s']:.2f} s (store init {opened['store_init_s']:.2f} s); token equal "
          f"{opened['token_equal']}, max |logit diff| {opened['max_abs_logit_diff']:.2e}")
    warm = opened["warmed_up_process"]
    print(f"  after a warm-up step ({warm['process_warm_up_s']:.2f} s): open {warm['open_s']:.2f} s + first "
          f"token {warm['first_token_s']:.2f} s; token equal {warm['token_equal']}; store.load "
          f"{warm['blocks_loaded_after_first_token']} blocks {warm['load_s']:.2f} s; next tokens "
          f"{', '.join(f'{t:.3f}' for t in warm['next_tokens_s'])} s ({', '.join(warm['next_tokens_path'])}; "
          f"without load: {', '.join(f'{t:.2f}' for t in opened['next_tokens_s'])} s, "
          f"{', '.join(opened['next_tokens_path'])})")
    background = opened["background_load_process"]
    if background:
        print(describe(background["background"]))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", default="bench", choices=("bench", "open"))  # open: the child
    parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    for name, value in PRESETS["cpu"].items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--path", default=None)
    parser.add_argument("--last", type=int, default=0)
    parser.add_argument("--warm-up", action="store_true")  # the child: one step on a throwaway sequence first
    parser.add_argument("--load", action="store_true")  # the child: store.load of the context after its first token
    parser.add_argument("--background", action="store_true")  # a child that opens with background_load=True
    parser.add_argument("--background-tokens", type=int, default=2000)  # at most this many tokens while it loads
    parser.add_argument("--profile", type=int, default=0)  # N: each child prints cProfile's top N of its first token
    return preset_defaults(parser.parse_args(argv), PRESETS)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.what == "open":
        return open_in_this_process(args)
    directory = tempfile.mkdtemp(prefix="kvtier-contexts-", dir=Path(args.out).parent if args.out else None)
    try:
        rows = [run_context(args, parse_tokens(c), directory) for c in args.contexts.split(",") if c]
        for r in rows:
            print(f"{r['context']:>8} tokens: save {r['save_s']:.2f} s; open {r['open_s'] * 1e3:.0f} ms reading "
                  f"{r['open_read_bytes'] / 2**20:.1f} MiB (sketch codes on first sketch attend: "
                  f"{r['bytes_read_by_first_attends'] / 2**20:.1f} MiB)")
        opened = run_new_process(args, parse_tokens(args.open_tokens), directory) if args.open_tokens != "0" else None
        if opened:
            print_opened(opened)
        forks = run_forks(args, parse_tokens(args.fork_tokens), directory) if args.fork_tokens != "0" else None
        if forks:
            print(f"10 forks of {forks['prefix_tokens']} tokens: {forks['blocks_ratio']:.4f}x blocks, "
                  f"{forks['bytes_ratio']:.4f}x bytes of the prefix alone")
        transfer = None
        if args.transfer_tokens != "0":
            transfer = run_transfer(lambda path: bench_config(args, path), fill, parse_tokens(args.transfer_tokens),
                                    directory, args.device)
            print(summary(transfer))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    result = {**{k: getattr(args, k) for k in PRESETS["cpu"]}, "preset": args.preset, "block_tokens": BLOCK_TOKENS,
              "environment": environment(torch.device(args.device)), "contexts": rows, "new_process": opened,
              "forks": forks, "transfer": transfer}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
