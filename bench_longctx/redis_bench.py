"""Redis tier put/get GB/s next to loopback ceilings measured in the same run.

    python -m bench_longctx.redis_bench [--mib 256] [--sizes 1,4] [--out FILE.json]

Starts its own redis-server and 3-master cluster (bench_longctx.redis_servers) on loopback
ports and moves `mib` MiB of K-like fp16 blocks through RedisTier as 1 and 4 MiB values
(8 kv heads x d128 at 256 and 1,024 tokens per block), stored raw and zstd level 1:
  put   RedisTier.put of the whole batch: encode + checksum + pipelined SET NX, acknowledged
  get   RedisTier.get of the whole batch: pipelined GETs whose replies are received straight
        into one new batch, each value verified where it landed
on one instance, one with `appendonly yes` + `appendfsync always` (durable puts) and the cluster.
Ceilings, measured in the same run:
  memcpy (same pieces)  host copy of the same values into touched memory
  fresh-memory copy     the same copy into a newly allocated buffer: what any get that returns
                        new memory pays in first-touch page faults
  loopback socket       one connected TCP pair on 127.0.0.1, a sender thread to a receiver,
                        512 MiB in 4 MiB sends
  C client              redis-benchmark SET/GET of the same value size (what the server gives here)
  redis-py              the client library alone: pipelined SET/GET of ready-made bytes
Each row gives the median GB/s of `repeat` runs and the slowest and fastest (`GBps_range`): the
2-core box is shared, so the spread is part of the result. `kvtier bench tiers` calls run_redis;
its rows land beside the other tiers' moves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile

import redis
import torch

from bench_longctx.redis_servers import RedisCluster, RedisServer, missing_binaries
from bench_longctx.tiers_bench import kv_blocks
from bench_longctx.timing import fresh_copy_ceiling_GBps, memcpy_ceiling_GBps, socket_ceiling_GBps, time_ms, timed
from tiers.layout import BlockLayout
from tiers.redis import RedisTier

_CPU = torch.device("cpu")


def c_client_GBps(port: int, value_bytes: int, total_bytes: int) -> dict[str, float]:
    """redis-benchmark (the C client, 16 commands per pipeline, one connection) SET and GET of
    one key with values of this size: what the server gives on this machine."""
    n = max(32, total_bytes // value_bytes)
    out = subprocess.run(["redis-benchmark", "-p", str(port), "-t", "set,get", "-d", str(value_bytes), "-n", str(n),
                          "-P", "16", "-c", "1", "--csv"], capture_output=True, text=True, timeout=600, check=True)
    rps = {row[0].strip('"'): float(row[1].strip('"')) for row in (line.split(",") for line in out.stdout.splitlines()[1:])}
    return {"set_GBps": rps["SET"] * value_bytes / 1e9, "get_GBps": rps["GET"] * value_bytes / 1e9}


def redis_py_GBps(url: str, value_bytes: int, total_bytes: int, repeat: int) -> dict[str, float]:
    """redis-py as installed (hiredis packer and parser), pipelined SET and GET of ready-made bytes:
    what the client library gives before the tier encodes, verifies or copies anything."""
    n = max(1, total_bytes // value_bytes)
    keys, value = [f"bench:{i}".encode() for i in range(n)], os.urandom(value_bytes)

    def pipeline(command) -> list:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            command(pipe, key)
        return pipe.execute()

    with redis.Redis.from_url(url, socket_timeout=120) as client:
        set_ms = time_ms(lambda: pipeline(lambda p, k: p.set(k, value)), _CPU, repeat)
        get_ms = time_ms(lambda: pipeline(lambda p, k: p.get(k)), _CPU, repeat)
        client.delete(*keys)
    return {"set_GBps": n * value_bytes / set_ms / 1e6, "get_GBps": n * value_bytes / get_ms / 1e6}


def bench_tier(url: str, value_mib: int, total_mib: int, compression: str, repeat: int) -> list[dict]:
    """Put and get of total_mib MiB as value_mib MiB blocks through one RedisTier."""
    layout = BlockLayout(num_kv_heads=8, block_tokens=256 * value_mib, head_dim=128)
    n = max(1, total_mib // value_mib)
    x = kv_blocks(layout, n, _CPU)  # [n, 2, 8, B, 128]
    nbytes = n * layout.fp16_bytes
    tier = RedisTier(layout, url, 1 << 40, compression=compression)
    ids = list(range(n))
    try:
        put_s = []
        for _ in range(repeat):
            put_s.append(timed(lambda: tier.put(ids, x))[1])
            tier.delete(ids)
        tier.put(ids, x)
        ratio = nbytes / tier.used_bytes
        assert torch.equal(tier.get(ids), x), "redis round trip returned other data"
        get_s = [timed(lambda: tier.get(ids))[1] for _ in range(repeat)]
    finally:
        tier.close()
    row = {"value_bytes": layout.fp16_bytes, "values": n, "compression": compression, "ratio": ratio}
    return [{**row, "op": op, **_rates(nbytes, seconds)} for op, seconds in (("put", put_s), ("get", get_s))]


def _rates(nbytes: int, seconds: list[float]) -> dict:
    """Median GB/s of the runs, and the slowest and fastest."""
    return {"GBps": nbytes / statistics.median(seconds) / 1e9,
            "GBps_range": [nbytes / max(seconds) / 1e9, nbytes / min(seconds) / 1e9]}


def run_redis(total_mib: int = 256, sizes_mib: tuple[int, ...] = (1, 4), repeat: int = 3,
              directory: str | None = None) -> dict:
    """Ceilings, then rows for one instance (raw and zstd), one with appendfsync always (raw) and
    the 3-master cluster (raw). directory: where the servers keep their files (the AOF's disk)."""
    reason = missing_binaries()
    if reason:
        return {"skipped": f"redis part skipped: {reason}"}
    nbytes = total_mib << 20
    ceilings = {"socket_GBps": socket_ceiling_GBps(), "fresh_copy_GBps": fresh_copy_ceiling_GBps(nbytes),
                "memcpy_GBps": {size: memcpy_ceiling_GBps(nbytes, size << 20) for size in sizes_mib}}
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-redis-", dir=directory) as tmp:
        for target in ("single", "single-durable", "cluster"):
            if target == "cluster":
                server = RedisCluster(f"{tmp}/cluster")
            else:  # durable: every acknowledged SET is in the AOF and fsynced (README)
                durable = ("--appendonly", "yes", "--appendfsync", "always") if target == "single-durable" else ()
                server = RedisServer(f"{tmp}/{target}", *durable)
            try:
                if target == "single":
                    ceilings["c_client"] = {size: c_client_GBps(server.port, size << 20, nbytes) for size in sizes_mib}
                    ceilings["redis_py"] = {size: redis_py_GBps(server.url, size << 20, nbytes, repeat)
                                            for size in sizes_mib}
                for size in sizes_mib:
                    for compression in ("none", "zstd") if target == "single" else ("none",):
                        rows += [{"target": target, **r} for r in bench_tier(server.url, size, total_mib,
                                                                               compression, repeat)]
            finally:
                server.stop()
    return {"total_bytes": nbytes, "ceilings": ceilings, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB moved per measurement")
    parser.add_argument("--sizes", default="1,4", help="value sizes in MiB, comma-separated")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args()
    result = run_redis(args.mib, tuple(int(s) for s in args.sizes.split(",")), args.repeat)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    c = result.get("ceilings", {})
    print(f"ceilings: socket {c.get('socket_GBps', 0):.2f} GB/s, fresh-memory copy {c.get('fresh_copy_GBps', 0):.2f} "
          f"GB/s, memcpy {c.get('memcpy_GBps')}")
    for r in result.get("rows", [result]):
        print(r)


if __name__ == "__main__":
    main()
