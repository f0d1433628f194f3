"""Sidecar throughput over loopback: put/get of 64 KiB - 4 MiB values, single and batched.

    python -m bench_longctx.service_bench --out DIR [--sizes 64K,256K,1M,4M] [--mib 64] [--batch-mib 16]

Starts a real `python -m kvstore.service` on a free loopback port (fsync per commit, the
default durability), drives it with tiers.remote.client.Client from this process, and
reports per (value size, op, single|batched): GB/s and p50/p99 request latency, next to a
single-threaded memcpy of the same bytes measured in the same run. Also: batched gets
served from LMDB instead of the CPU cache (a restarted server with --cpu-bytes 0; the OS
page cache is warm) and single puts without fsync (--no-sync), the cost of durability.
Writes DIR/service_cpu.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench_longctx.timing import memcpy_ceiling_GBps, timed
from kvstore.service.serve import parse_bytes
from kvstore.service.protocol import http_protocols
from tiers.remote.client import Client

GOAL_BATCHED_GET_GBPS = 2.0


class Server:
    def __init__(self, data_dir: str, *args: str) -> None:
        self.data_dir = data_dir
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.url = f"http://127.0.0.1:{s.getsockname()[1]}"
        cmd = [sys.executable, "-m", "kvstore.service", "--data-dir", data_dir, "--port", self.url.rsplit(":", 1)[1],
               "--max-value-bytes", "64M", "--max-body-bytes", "512M", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with Client(self.url) as c:
            deadline = time.monotonic() + 120
            while not c.health():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server did not start: {cmd}")
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def requests(calls: list, nbytes: int) -> dict:
    """Run each zero-argument call once; throughput over all, latency per call."""
    latencies = [timed(call)[1] for call in calls]
    total = sum(latencies)
    ms = np.array(latencies) * 1e3
    return {"requests": len(calls), "bytes": nbytes, "seconds": round(total, 4),
            "gb_per_s": round(nbytes / total / 1e9, 3),
            "p50_ms": round(float(np.percentile(ms, 50)), 3), "p99_ms": round(float(np.percentile(ms, 99)), 3)}


def values_for(size: int, count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(size)
    pool = [torch.randn(size // 2, generator=g).half() for _ in range(min(count, 8))]  # each [size / 2] fp16
    return [pool[i % len(pool)] for i in range(count)]


def bench_size(c: Client, size: int, mib: int, batch_mib: int) -> list[dict]:
    count = max(4, (mib << 20) // size)
    per = max(1, (batch_mib << 20) // size)
    keys, values = [f"s{size}/{i:06d}" for i in range(count)], values_for(size, count)
    batches = [list(range(i, min(i + per, count))) for i in range(0, count, per)]
    nbytes = count * size
    rows = [
        ("put", "single", requests([lambda i=i: c.put("bench", keys[i], values[i]) for i in range(count)], nbytes)),
        ("put", "batched", requests([lambda b=b: c.put_many("bench", [(keys[i], values[i]) for i in b])
                                  for b in batches], nbytes)),
        ("get", "single", requests([lambda i=i: c.get("bench", keys[i]) for i in range(count)], nbytes)),
        ("get", "batched", requests([lambda b=b: c.get_many("bench", [keys[i] for i in b]) for b in batches], nbytes)),
    ]
    memcpy = {"single": memcpy_ceiling_GBps(nbytes, size),
              "batched": memcpy_ceiling_GBps(nbytes, min(per, count) * size)}
    out = []
    for op, mode, stats in rows:
        values_per_request = 1 if mode == "single" else min(per, count)
        out.append({"value_bytes": size, "op": op, "mode": mode, "values_per_request": values_per_request, **stats,
                    "memcpy_gb_per_s": round(memcpy[mode], 3),
                    "fraction_of_memcpy": round(stats["gb_per_s"] / memcpy[mode], 3)})
        print(_row(out[-1]), flush=True)
    return out


def bench_extras(data_dir: str, sizes: list[int], mib: int, batch_mib: int) -> list[dict]:
    """Batched gets served from LMDB (empty CPU cache) and single puts without fsync."""
    out = []
    server = Server(data_dir, "--cpu-bytes", "0")
    with Client(server.url) as c:
        for size in sizes:
            count, per = max(4, (mib << 20) // size), max(1, (batch_mib << 20) // size)
            keys = [f"s{size}/{i:06d}" for i in range(count)]
            stats = requests([lambda s=s: c.get_many("bench", keys[s:s + per]) for s in range(0, count, per)],
                             count * size)
            out.append({"value_bytes": size, "op": "get", "mode": "batched, from LMDB", "values_per_request": per, **stats})
            print(_row(out[-1]), flush=True)
    server.stop()
    server = Server(tempfile.mkdtemp(prefix="kvtier-bench-nosync-"), "--no-sync")
    with Client(server.url) as c:
        for size in sizes:
            count = max(4, (mib << 20) // size // 2)
            values = values_for(size, count)
            stats = requests([lambda i=i: c.put("nosync", f"k{i}", values[i]) for i in range(count)], count * size)
            out.append({"value_bytes": size, "op": "put", "mode": "single, no fsync", "values_per_request": 1, **stats})
            print(_row(out[-1]), flush=True)
    server.stop()
    shutil.rmtree(server.data_dir, ignore_errors=True)
    return out


def _row(r: dict) -> str:
    frac = f"{r['fraction_of_memcpy']:.2f}" if "fraction_of_memcpy" in r else "-"
    memcpy = f"{r['memcpy_gb_per_s']:.2f}" if "memcpy_gb_per_s" in r else "-"
    return (f"| {r['value_bytes'] >> 10} KiB | {r['op']} | {r['mode']} | {r['values_per_request']} | "
            f"{r['gb_per_s']:.3f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {memcpy} | {frac} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for service_cpu.json")
    parser.add_argument("--sizes", default="64K,256K,1M,4M")
    parser.add_argument("--mib", type=int, default=64, help="MiB moved per value size and op")
    parser.add_argument("--batch-mib", type=int, default=16, help="MiB per batched request")
    args = parser.parse_args(argv)
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    data_dir = tempfile.mkdtemp(prefix="kvtier-bench-")
    load_before = os.getloadavg()
    print("| value | op | mode | values/request | GB/s | p50 ms | p99 ms | memcpy GB/s | of memcpy |")
    print("|---|---|---|---|---|---|---|---|---|")
    server = Server(data_dir, "--cpu-bytes", str(2 * args.mib * len(sizes) << 20))
    try:
        with Client(server.url) as c:
            rows = [r for size in sizes for r in bench_size(c, size, args.mib, args.batch_mib)]
    finally:
        server.stop()
    rows += bench_extras(data_dir, sizes, args.mib, args.batch_mib)
    shutil.rmtree(data_dir, ignore_errors=True)
    best_get = max(r["gb_per_s"] for r in rows if r["op"] == "get" and r["mode"] == "batched")
    result = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "server": {"durability": "fsync per commit", "compression": "none",
                   "http": f"uvicorn with {http_protocols()[0]} (loop auto: uvloop when installed); "
                           "client: httpx, gets via http.client readinto"},
        "goal": {"batched_get_gb_per_s": GOAL_BATCHED_GET_GBPS, "best_batched_get_gb_per_s": best_get,
                 "met": best_get >= GOAL_BATCHED_GET_GBPS},
        "results": rows,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "service_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"best batched get {best_get:.2f} GB/s (goal {GOAL_BATCHED_GET_GBPS}); wrote {Path(args.out) / 'service_cpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
