"""Sidecar prefix routes over loopback: look a prompt up, then fetch its held chunks, batched.

    python -m bench_longctx.prefix_bench --out DIR [--gib 1] [--block-tokens 256] [--batch-mib 64]
                                          [--http httptools,h11] [--streams 1,3] [--repeat 3]

Per HTTP parser, starts a real `python -m kvstore.service` on a free loopback port, stores a
prompt's chunks by hash (tiers/keys.py; one chunk = every layer's K/V of block_tokens tokens of
a 16-layer, 2-KV-head, head_dim 64 fp16 model: block_tokens x 8 KiB), then times passes of
Client.lookup_prefix (token ids -> held tokens) + Client.retrieve_chunks of every held chunk in
requests of --batch-mib on --streams threads (each reading into its own reused staging buffer),
and the generic batched get (get_many) of the same values. Reported
next to ceilings measured in the same run: a single-threaded memcpy of the same bytes in
request-sized pieces, a copy into fresh memory (what every read that returns new buffers pays)
and one loopback TCP stream. Writes DIR/prefix_cpu.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from bench_longctx.service_bench import Server
from bench_longctx.timing import fresh_copy_ceiling_GBps, memcpy_ceiling_GBps, socket_ceiling_GBps, timed
from tiers.keys import ChunkKeys
from tiers.remote.client import Client

GOAL_GBPS = 2.0


def chunk_keys(block_tokens: int) -> ChunkKeys:
    return ChunkKeys("prefix-bench", num_layers=16, num_q_heads=8, num_kv_heads=2, head_dim=64,
                     block_tokens=block_tokens)


def store_prompt(c: Client, keys: ChunkKeys, num_chunks: int, batch_chunks: int) -> tuple[list[int], list, float]:
    """Store a prompt's chunks; returns its token ids, the distinct chunk tensors and the seconds it took."""
    g = torch.Generator().manual_seed(0)
    token_ids = torch.randint(0, 128_000, (num_chunks * keys.block_tokens,), generator=g).tolist()
    shape = (keys.num_layers, 2, keys.num_kv_heads, keys.block_tokens, keys.head_dim)  # [L, 2, H, B, D]
    pool = [torch.randn(shape, generator=g).half() for _ in range(8)]
    hashes = keys.hashes(token_ids)
    start = time.perf_counter()
    for s in range(0, num_chunks, batch_chunks):
        answer = c.store_chunks("bench", [(h, pool[i % 8]) for i, h in enumerate(hashes[s:s + batch_chunks], s)])
        assert answer["held"] == 0, answer
    return token_ids, pool, time.perf_counter() - start


class Fetcher:
    """Fetches batches of chunks on `streams` threads (one connection and one reused staging buffer
    each, as an engine's loader threads would), so one request's send overlaps another's checks."""

    def __init__(self, c: Client, streams: int, staging_bytes: int) -> None:
        self.c, self.staging_bytes, self.local = c, staging_bytes, threading.local()
        self.pool = ThreadPoolExecutor(streams)

    def fetch(self, hashes: tuple[str, ...], pool: list, first: int, check: bool) -> float:
        if not hasattr(self.local, "staging"):
            self.local.staging = torch.ones(self.staging_bytes, dtype=torch.uint8)  # [bytes], touched once
        chunks, seconds = timed(lambda: self.c.retrieve_chunks("bench", hashes, into=self.local.staging))
        if check:  # bit-exact against what was stored (the client already verified every checksum)
            assert all(torch.equal(t.view(torch.int16), pool[i % 8].view(torch.int16))
                       for i, t in enumerate(chunks, first))
        return seconds

    def close(self) -> None:
        self.pool.shutdown()


def lookup_and_fetch(c: Client, fetcher: Fetcher, keys: ChunkKeys, token_ids: list[int], batch_chunks: int,
                     pool: list, check: bool) -> dict:
    """One pass: lookup, then every held chunk fetched in batches; seconds of each step."""
    start = time.perf_counter()
    held = c.lookup_prefix("bench", token_ids, keys)
    lookup_s = time.perf_counter() - start
    assert held.num_tokens == len(token_ids), (held.num_tokens, len(token_ids))
    firsts = range(0, held.num_chunks, batch_chunks)
    batch_s = list(fetcher.pool.map(
        lambda s: fetcher.fetch(held.chunk_hashes[s:s + batch_chunks], pool, s, check), firsts))
    return {"lookup_ms": lookup_s * 1e3, "total_s": time.perf_counter() - start,
            "batch_ms": [b * 1e3 for b in batch_s]}


def generic_get(c: Client, hashes: tuple[str, ...], batch_chunks: int) -> float:
    start = time.perf_counter()
    for s in range(0, len(hashes), batch_chunks):
        c.get_many("bench", [f"chunk/{h}" for h in hashes[s:s + batch_chunks]])
    return time.perf_counter() - start


def bench_parser(http: str, keys: ChunkKeys, num_chunks: int, batch_chunks: int, repeat: int,
                 streams: int) -> dict:
    data_dir = tempfile.mkdtemp(prefix=f"kvtier-prefix-{http}-")
    nbytes = num_chunks * keys.block_tokens * 8192
    server = Server(data_dir, "--http", http, "--cpu-bytes", str(nbytes + (256 << 20)))
    try:
        with Client(server.url) as c:
            token_ids, pool, store_s = store_prompt(c, keys, num_chunks, batch_chunks)
            fetcher = Fetcher(c, streams, batch_chunks * keys.block_tokens * 8192 + (1 << 20))
            passes = [lookup_and_fetch(c, fetcher, keys, token_ids, batch_chunks, pool, check=i == 0)
                      for i in range(repeat + 1)]
            fetcher.close()
            passes = passes[1:]  # the first round checks every byte and warms connections and buffers; not timed
            hashes = c.lookup_prefix("bench", token_ids, keys).chunk_hashes
            generic = [generic_get(c, hashes, batch_chunks) for _ in range(repeat)]
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    best = min(passes, key=lambda p: p["total_s"])
    ms = np.array([b for p in passes for b in p["batch_ms"]])
    return {
        "http": http, "streams": streams, "bytes": nbytes, "chunks": num_chunks, "chunk_bytes": nbytes // num_chunks,
        "tokens": len(token_ids), "chunks_per_request": batch_chunks,
        "store_gb_per_s": round(nbytes / store_s / 1e9, 3),
        "lookup_ms_best": round(min(p["lookup_ms"] for p in passes), 2),
        "lookup_plus_fetch_gb_per_s_best": round(nbytes / best["total_s"] / 1e9, 3),
        "lookup_plus_fetch_gb_per_s_median": round(nbytes / float(np.median([p["total_s"] for p in passes])) / 1e9, 3),
        "fetch_request_p50_ms": round(float(np.percentile(ms, 50)), 2),
        "fetch_request_p99_ms": round(float(np.percentile(ms, 99)), 2),
        "generic_batched_get_gb_per_s_best": round(nbytes / min(generic) / 1e9, 3),
        "passes": repeat,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for prefix_cpu.json")
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of chunks looked up and fetched per pass")
    parser.add_argument("--block-tokens", type=int, default=256, help="tokens per chunk (x 8 KiB per chunk)")
    parser.add_argument("--batch-mib", type=int, default=64, help="MiB per retrieve request")
    parser.add_argument("--http", default="httptools,h11", help="the sidecar's HTTP parsers to compare")
    parser.add_argument("--streams", default="1,3", help="concurrent fetch requests to compare")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes per parser (best and median kept)")
    args = parser.parse_args(argv)
    keys = chunk_keys(args.block_tokens)
    chunk_bytes = args.block_tokens * 8192
    num_chunks = int(args.gib * (1 << 30)) // chunk_bytes
    batch_chunks = max(1, (args.batch_mib << 20) // chunk_bytes)
    load_before = os.getloadavg()
    rows = []
    print("| server | streams | lookup ms | lookup + fetch GB/s (best / median) | request p50 / p99 ms "
          "| get_many GB/s | store GB/s |")
    print("|---|---|---|---|---|---|---|")
    for http, streams in [(h, int(n)) for h in args.http.split(",") for n in args.streams.split(",")]:
        rows.append(bench_parser(http, keys, num_chunks, batch_chunks, args.repeat, streams))
        r = rows[-1]
        print(f"| {http} + uvloop | {streams} | {r['lookup_ms_best']} | {r['lookup_plus_fetch_gb_per_s_best']:.2f} / "
              f"{r['lookup_plus_fetch_gb_per_s_median']:.2f} | "
              f"{r['fetch_request_p50_ms']} / {r['fetch_request_p99_ms']} | "
              f"{r['generic_batched_get_gb_per_s_best']:.2f} | {r['store_gb_per_s']:.2f} |", flush=True)
    nbytes = num_chunks * chunk_bytes
    ceilings = {"memcpy_gb_per_s": round(memcpy_ceiling_GBps(nbytes, batch_chunks * chunk_bytes), 3),
                "fresh_copy_gb_per_s": round(fresh_copy_ceiling_GBps(batch_chunks * chunk_bytes), 3),
                "loopback_socket_gb_per_s": round(socket_ceiling_GBps(512 << 20, 4 << 20), 3)}
    best = max(r["lookup_plus_fetch_gb_per_s_best"] for r in rows)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["python -m bench_longctx.prefix_bench", *(argv or sys.argv[1:])]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "load_average_before": load_before,
                    "load_average_after": os.getloadavg()},
        "ceilings": ceilings,
        "goal": {"lookup_plus_fetch_gb_per_s": GOAL_GBPS, "best": best, "met": best >= GOAL_GBPS},
        "results": rows,
    }
    print(f"ceilings: {ceilings}; best lookup + fetch {best:.2f} GB/s (goal {GOAL_GBPS})")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "prefix_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
