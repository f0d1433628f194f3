"""Sidecar soak: many concurrent clients for a fixed time; errors and server memory over time.

    python -m bench_longctx.service_soak [--clients 512] [--seconds 60] [--out DIR]

Starts a real `python -m kvstore.service` on a free loopback port (fsync per commit) and
runs `--clients` asyncio clients, one kept-alive connection each, for `--seconds`. Each
client cycles through its own 8 keys: put a 1-16 KiB value, get it back and compare the
bytes, every 8th round a batch get of all 8 and a key listing. The data set is bounded
(clients x 8 values), so server memory should stay flat after warm-up. Errors are any
non-2xx answer, transport error or wrong bytes. Prints and writes DIR/service_soak.json;
exits 1 on any error. Not a CI test: it runs for minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from tiers.remote.wire import unpack_batch

KEYS_PER_CLIENT = 8


async def client_loop(url: str, client_id: int, deadline: float, stats: dict) -> None:
    rng = random.Random(client_id)
    values: dict[str, bytes] = {}
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as http:
        round_ = 0
        while time.monotonic() < deadline:
            key = f"c{client_id}/k{round_ % KEYS_PER_CLIENT}"
            try:
                await one_round(http, rng, key, values, round_, stats)
            except (httpx.HTTPError, AssertionError, ValueError) as exc:
                stats["errors"] += 1
                stats["error_kinds"][f"{type(exc).__name__}: {str(exc)[:80]}"] = \
                    stats["error_kinds"].get(f"{type(exc).__name__}: {str(exc)[:80]}", 0) + 1
            round_ += 1


async def one_round(http: httpx.AsyncClient, rng: random.Random, key: str, values: dict[str, bytes],
                    round_: int, stats: dict) -> None:
    body = rng.randbytes(rng.randint(1, 16) << 10)
    headers = {"x-kvtier-dtype": "uint8", "x-kvtier-shape": str(len(body)), "x-kvtier-layout": "1"}
    start = time.perf_counter()
    r = await http.put(f"/v1/namespaces/soak/blocks/{key}", content=body, headers=headers)
    assert r.status_code == 201, f"put {r.status_code}"
    values[key] = body
    r = await http.get(f"/v1/namespaces/soak/blocks/{key}")
    assert r.status_code == 200 and r.content == body, f"get {r.status_code}"
    stats["latencies"].append(time.perf_counter() - start)
    stats["requests"] += 2
    if round_ % 8 == 7:
        keys = sorted(values)
        r = await http.post("/v1/namespaces/soak/batch/get", json={"keys": keys})
        assert r.status_code == 200, f"batch get {r.status_code}"
        items = unpack_batch(memoryview(r.content))
        assert [bytes(r.content[o:o + n]) for _, _, _, o, n in items] == [values[k] for k in keys], "batch bytes"
        prefix = key.split("/")[0] + "/"
        r = await http.get("/v1/namespaces/soak/keys", params={"prefix": prefix})
        assert r.status_code == 200 and r.json()["keys"] == keys, f"keys {r.status_code}"
        stats["requests"] += 2


async def sample_memory(pid: int, deadline: float, samples: list) -> None:
    process, start = psutil.Process(pid), time.monotonic()
    while time.monotonic() < deadline:
        samples.append((round(time.monotonic() - start, 1), process.memory_info().rss))
        await asyncio.sleep(2.0)


async def soak(url: str, pid: int, clients: int, seconds: float) -> dict:
    stats = {"requests": 0, "errors": 0, "error_kinds": {}, "latencies": []}
    memory: list = []
    deadline = time.monotonic() + seconds
    await asyncio.gather(sample_memory(pid, deadline, memory),
                         *(client_loop(url, i, deadline, stats) for i in range(clients)))
    latencies = sorted(stats.pop("latencies"))
    warm = [rss for t, rss in memory if t >= 10] or [memory[-1][1]]
    return {**stats, "clients": clients, "seconds": seconds, "requests_per_s": round(stats["requests"] / seconds),
            "put_get_p50_ms": round(1e3 * latencies[len(latencies) // 2], 1) if latencies else None,
            "put_get_p99_ms": round(1e3 * latencies[int(len(latencies) * 0.99)], 1) if latencies else None,
            "rss_mib_at_10s": round(warm[0] / 2**20, 1), "rss_mib_end": round(memory[-1][1] / 2**20, 1),
            "rss_mib_max": round(max(r for _, r in memory) / 2**20, 1),
            "rss_mib_series": [(t, round(r / 2**20, 1)) for t, r in memory]}


def start_server(data_dir: str, port: int) -> subprocess.Popen:
    repo = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "kvstore.service", "--data-dir", data_dir, "--port", str(port), "--cpu-bytes", "64M"]
    proc = subprocess.Popen(cmd, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the sidecar did not start")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--port", type=int, default=18472)
    parser.add_argument("--out", default=None, help="directory for service_soak.json")
    args = parser.parse_args(argv)
    data_dir = tempfile.mkdtemp(prefix="kvtier-soak-")
    proc = start_server(data_dir, args.port)
    try:
        result = asyncio.run(soak(f"http://127.0.0.1:{args.port}", proc.pid, args.clients, args.seconds))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(data_dir, ignore_errors=True)
    print(json.dumps({k: v for k, v in result.items() if k != "rss_mib_series"}, indent=1))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, "service_soak.json").write_text(json.dumps(result, indent=1))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
