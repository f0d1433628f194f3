"""Time to first token in vLLM with KVTierConnector vs without a connector, on one trace.

    python -m bench_longctx.vllm_ttft --model /path/to/hf-folder [--prefix-tokens 4096] [--requests 4]

The trace: --requests prompts of one --prefix-tokens prefix and different 64-token suffixes. Without a
connector, a fresh engine computes every prompt (vLLM's own prefix cache off, so each request pays
the prefix, as a second engine would). With the connector, one engine first stores the prefix in a
fresh sidecar; then a fresh engine (its own prefix cache off: every hit comes from the sidecar) runs
the trace. TTFT is the wall time of a request with max_tokens=1, one request at a time. Each engine
runs in its own process (vLLM needs the __main__ guard). Needs vLLM (see docs/vllm-connector.md).
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

import httpx

PROSE = Path(__file__).resolve().parents[1] / "tests" / "data" / "prose.txt"
SUFFIX_TOKENS = 64
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "TOKENIZERS_PARALLELISM": "false"}


def engine_ttft(model: str, prompts: list[list[int]], url: str | None) -> dict:
    """Seconds to the first token of each prompt, one at a time, in a fresh engine of this process."""
    from vllm import LLM, SamplingParams

    transfer = None if url is None else {
        "kv_connector": "KVTierConnector", "kv_connector_module_path": "engine_adapter.vllm_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"url": url, "namespace": "ttft", "model_id": "bench"}}
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


def trace(model: str, prefix_tokens: int, num_requests: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    text = PROSE.read_text(encoding="utf-8")
    ids = AutoTokenizer.from_pretrained(model)(text)["input_ids"]
    while len(ids) < prefix_tokens + SUFFIX_TOKENS * (num_requests + 1):
        ids = ids + ids
    prefix, rest = ids[:prefix_tokens], ids[prefix_tokens:]
    return [prefix + rest[i * SUFFIX_TOKENS: (i + 1) * SUFFIX_TOKENS] for i in range(num_requests + 1)]


def in_process(model: str, prompts: list[list[int]], url: str | None) -> dict:
    args = json.dumps({"model": model, "prompts": prompts, "url": url})
    env = {**os.environ, **ENV, "PYTHONPATH": str(PROSE.parents[2])}
    command = [sys.executable, "-m", "bench_longctx.vllm_ttft", "--model", model, "--engine", args]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"engine failed ({proc.returncode}): {proc.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def start_sidecar(data_dir: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.service", "--data-dir", data_dir, "--port", str(port),
                             "--no-sync"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/healthz", timeout=1.0).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the sidecar did not start")


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + " ", name + "{")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model folder")
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        job = json.loads(args.engine)
        print("RESULT " + json.dumps(engine_ttft(job["model"], job["prompts"], job["url"])), flush=True)
        return
    prompts = trace(args.model, args.prefix_tokens, args.requests)
    store, measured = prompts[:1], prompts[1:]
    recompute = in_process(args.model, measured, None)
    with tempfile.TemporaryDirectory() as data_dir:
        sidecar, url = start_sidecar(data_dir)
        try:
            in_process(args.model, store, url)
            sent = metric(url, "kvtier_bytes_out_total")
            loaded = in_process(args.model, measured, url)
            sent = metric(url, "kvtier_bytes_out_total") - sent
        finally:
            sidecar.terminate()
            sidecar.wait()
    base, kv = statistics.median(recompute["seconds"]), statistics.median(loaded["seconds"])
    print(f"prefix {args.prefix_tokens} tokens + {SUFFIX_TOKENS}, {len(measured)} requests, median TTFT")
    print(f"  no connector: {base * 1e3:8.1f} ms  {[round(s * 1e3) for s in recompute['seconds']]}")
    print(f"  kvtier:       {kv * 1e3:8.1f} ms  {[round(s * 1e3) for s in loaded['seconds']]}  "
          f"cached tokens {loaded['cached']}")
    print(f"  speedup {base / kv:.2f}x; {sent / len(measured) / 1e6:.1f} MB fetched per request, "
          f"{sent / len(measured) / kv / 1e9:.2f} GB/s over the whole TTFT")


if __name__ == "__main__":
    main()
