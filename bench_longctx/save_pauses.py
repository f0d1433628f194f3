"""The pause a decoding sequence sees while another sequence is saved: store.save (synchronous: nothing decodes
until it returns) against store.save(..., background=True), which the Decoder pumps before every token.

    python -m bench_longctx.save_pauses --preset cpu [--out FILE]           # 2-core CPU, tiny geometry, ~2 min
    python -m bench_longctx.save_pauses --preset h200 --save-tokens 512K [--decode-saved] [--runs background]

A context of --save-tokens (random K/V of the geometry with token ids, contexts_store.py's store and windows) is
saved twice (--runs sync,background), each by a fresh store into a fresh ssd_path (under --dir; removed after):
once synchronously, once in the background while a second sequence (a --prompt-tokens prompt, a random-weight
Llama of the geometry; with --decode-saved the saved sequence too, in one batch) decodes greedily, one synchronized
token at a time, until the save is durable. Reported: the synchronous save's seconds (the longest pause: every
sequence waits for it); the background call's own seconds, then the decoded tokens' seconds during the save
(longest, median) beside the same tokens before it (baseline), the tokens decoded and the save's seconds from call
to durable; each pump's seconds and what it copied; the blocks copied by tier moves and the seconds each move
spent on them; the garbage collections meanwhile (any thread's: a collection holds the GIL) and which of the
tokens over 100 ms overlapped one. Before the save the heap is frozen as a serving process does once loaded
(kvstore/heap.py); --no-freeze-heap leaves it as it is (the baseline).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench_longctx.contexts_bench import decoder
from bench_longctx.contexts_store import VOCAB, bench_config, fill, preset_defaults
from bench_longctx.presets import parse_tokens
from bench_longctx.timing import GcPauses, environment, sync, timed, timed_calls
from kvstore.heap import frozen_heap
from kvstore.store import KVStore

LONG_TOKEN_S = 0.1  # a token this long is reported with the collections it overlapped
PRESETS = {
    "cpu": dict(geometry="smollm2-135m", layers=4, save_tokens="128K", prompt_tokens="256", device="cpu",
                gpu_bytes=256 << 20, cpu_bytes=256 << 20, ssd_bytes=16 << 30, warm_tokens=2048, baseline_tokens=20),
    "h200": dict(geometry="llama3-8b", layers=32, save_tokens="512K", prompt_tokens="4K", device="cuda",
                 gpu_bytes=16 << 30, cpu_bytes=48 << 30, ssd_bytes=96 << 30, warm_tokens=2048, baseline_tokens=50),
}


def run(args: argparse.Namespace, background: bool) -> dict:
    """One save of a filled context into a fresh ssd_path (removed after), synchronous or in the background while
    another sequence decodes."""
    directory = tempfile.mkdtemp(prefix="kvtier-save-pauses-", dir=args.dir)
    try:
        return _run(args, directory, background)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _run(args: argparse.Namespace, directory: str, background: bool) -> dict:
    with KVStore(bench_config(args, directory)) as store:
        saved, _ = fill(store, parse_tokens(args.save_tokens))
        dec = decoder(store, args)
        if args.pump_bytes:
            store.saves.pump_blocks = max(1, args.pump_bytes // store.layout.fp16_bytes)
        seq = store.create_sequence()
        prompt = torch.randint(0, VOCAB, (parse_tokens(args.prompt_tokens),),
                               generator=torch.Generator().manual_seed(1))
        token = int(dec.prefill(seq, prompt).argmax())
        seqs, tokens = ([seq, saved], [token, 0]) if args.decode_saved else ([seq], [token])

        starts: list[float] = []

        def step() -> float:  # one token of every decoding sequence, synchronized: its seconds
            nonlocal tokens
            starts.append(time.perf_counter())
            logits, seconds = timed(lambda: dec.decode_batch(seqs, tokens, "topk", 4096), args.device)
            tokens = logits.argmax(dim=1).tolist()
            return seconds

        baseline = [step() for _ in range(args.baseline_tokens)]
        if not background:
            _, save_s = timed(lambda: store.save(saved, "ctx"), args.device)
            return {"save_s": save_s, "baseline_token_s": baseline, "written": store.saved.blocks.counts}
        pumps: list[tuple[float, int]] = []
        store.pump_saves = timed_calls(store.pump_saves, pumps)  # what the Decoder calls before every token
        moves, leaving = [], store.saves._leaving

        def timed_leaving(ids: list[int], tier: int) -> None:  # the copies a tier move makes of the save's blocks
            started = time.perf_counter()
            leaving(ids, tier)
            moves.append(time.perf_counter() - started)

        store.saves._leaving = timed_leaving  # registered with the tier set by the save below
        sync(args.device)
        del starts[:]
        # the heap frozen as a serving process does once loaded (kvstore/heap.py), unfrozen after
        with contextlib.nullcontext() if args.no_freeze_heap else frozen_heap(), GcPauses() as collections:
            started = time.perf_counter()
            job = store.save(saved, "ctx", background=True)
            call_s, during = time.perf_counter() - started, []
            while not job.done():
                during.append(step())
            job.wait()
            save_s = time.perf_counter() - started
        long = [i for i, s in enumerate(during) if s > LONG_TOKEN_S]
        return {"call_s": call_s, "save_s": save_s, "baseline_token_s": baseline,
                "token_s": during, "pump_s": [s for s, _ in pumps], "pump_blocks": [n for _, n in pumps],
                "pump_limit": store.saves.pump_blocks, "moves_s": moves, "progress": job.progress,
                "gc": {**collections.summary(), "freeze_heap": not args.no_freeze_heap, "long_tokens": len(long),
                       "long_token_gc_s": [collections.within(starts[i], starts[i] + during[i]) for i in long]}}


def summary(bg: dict) -> str:
    ms = lambda s: f"{1e3 * s:.1f} ms"  # noqa: E731
    during, base, g = bg["token_s"], bg["baseline_token_s"], bg["gc"]
    return (f"background save: call {ms(bg['call_s'])}; {len(during)} tokens decoded meanwhile, longest "
            f"{ms(max(during))}, median {ms(statistics.median(during))} (before the save: longest {ms(max(base))}, "
            f"median {ms(statistics.median(base))}); durable after {bg['save_s']:.2f} s\n"
            f"  pumps: longest {ms(max(bg['pump_s']))}, at most {max(bg['pump_blocks'])} of {bg['pump_limit']} "
            f"blocks a call; {bg['progress']['blocks_copied_by_moves']} blocks copied by moves (longest "
            f"{ms(max(bg['moves_s'], default=0))} a move); "
            f"{bg['progress']['blocks_written']} blocks, {bg['progress']['bytes_written'] / 2**30:.2f} GiB written\n"
            f"  garbage collections{'' if g['freeze_heap'] else ' (heap not frozen)'}: {g['collections']} "
            f"({g['full_collections']} full, longest {ms(g['longest_full_s'])}), longest {ms(g['longest_s'])}, "
            f"total {ms(g['total_s'])}; {g['long_tokens']} tokens over {ms(LONG_TOKEN_S)}, "
            f"{sum(s > 0 for s in g['long_token_gc_s'])} of them with a collection ({ms(sum(g['long_token_gc_s']))})")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    for name, value in PRESETS["cpu"].items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None)
    parser.add_argument("--decode-saved", action="store_true")  # the saved sequence decodes too (its blocks move)
    parser.add_argument("--pump-bytes", type=int, default=0)  # 0: the store's default (background_save.PUMP_BYTES)
    parser.add_argument("--runs", default="sync,background")  # one of them alone: two shorter commands
    parser.add_argument("--no-freeze-heap", action="store_true")  # the baseline: the heap not frozen before the save
    parser.add_argument("--dir", default=None)  # where each run's ssd_path goes (default: the temporary directory)
    parser.add_argument("--out", default=None)
    return preset_defaults(parser.parse_args(argv), PRESETS)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    runs = args.runs.split(",")
    sync_run = run(args, background=False) if "sync" in runs else None
    if sync_run:
        print(f"synchronous save: {sync_run['save_s']:.2f} s (every sequence waits)", flush=True)
    bg = run(args, background=True) if "background" in runs else None
    if bg:
        print(summary(bg))
    if args.out:
        result = {**{k: getattr(args, k) for k in PRESETS["cpu"]}, "preset": args.preset, "pump_bytes": args.pump_bytes,
                  "decode_saved": args.decode_saved, "freeze_heap": not args.no_freeze_heap,
                  "environment": environment(torch.device(args.device)), "synchronous": sync_run, "background": bg}
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
