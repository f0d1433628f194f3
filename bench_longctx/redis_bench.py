"""Redis tier put/get GB/s next to loopback ceilings measured in the same run.

    python -m bench_longctx.redis_bench [--mib 256] [--sizes 1,4] [--out FILE.json]

Starts its own redis-server and 3-master cluster (bench_longctx.redis_servers) on loopback
ports and moves `mib` MiB of K-like fp16 blocks through RedisTier as 1 and 4 MiB values
(8 kv heads x d128 at 256 and 1,024 tokens per block), stored raw and zstd level 1:
  put   RedisTier.put of the whole batch: encode + checksum + pipelined SET NX, acknowledged
  get   RedisTier.get of the whole batch: pipelined GET + verify + copy into one new batch
Ceilings, measured in the same run:
  memcpy (same pieces)  host copy of the same values into touched memory
  fresh-memory copy     the same copy into a newly allocated buffer: what any get that returns
                        new memory pays in first-touch page faults
  loopback socket       one connected TCP pair on 127.0.0.1, a sender thread to a receiver,
                        512 MiB in 4 MiB sends
`kvtier bench tiers` calls run_redis; its rows land beside the other tiers' moves.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import threading

import numpy as np
import torch

from bench_longctx.redis_servers import RedisCluster, RedisServer, missing_binaries
from bench_longctx.tiers_bench import kv_blocks
from bench_longctx.timing import memcpy_ceiling_GBps, time_ms, timed
from tiers.layout import BlockLayout
from tiers.redis import RedisTier

_CPU = torch.device("cpu")


def socket_ceiling_GBps(nbytes: int = 512 << 20, chunk: int = 4 << 20, repeat: int = 3) -> float:
    """One connected loopback TCP pair: a thread sends nbytes in `chunk` pieces, this one receives."""
    nbytes = nbytes // chunk * chunk
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as out:
        conn, _ = server.accept()
        data, buf = bytes(chunk), memoryview(bytearray(chunk))

        def send() -> None:
            for _ in range(nbytes // chunk):
                out.sendall(data)

        def transfer() -> None:
            sender = threading.Thread(target=send)
            sender.start()
            got = 0
            while got < nbytes:
                got += conn.recv_into(buf)
            sender.join()

        with conn:
            return nbytes / time_ms(transfer, _CPU, repeat) / 1e6


def fresh_copy_ceiling_GBps(nbytes: int, repeat: int = 3) -> float:
    """Copy into a newly allocated buffer each time (the allocation and its page faults timed)."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)

    def copy() -> None:
        dst = torch.empty(nbytes, dtype=torch.uint8).numpy()
        np.copyto(dst, src)

    return nbytes / time_ms(copy, _CPU, repeat) / 1e6


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
        get_ms = time_ms(lambda: tier.get(ids), _CPU, repeat)
    finally:
        tier.close()
    row = {"value_bytes": layout.fp16_bytes, "values": n, "compression": compression, "ratio": ratio}
    return [{**row, "op": "put", "GBps": nbytes / statistics.median(put_s) / 1e9},
            {**row, "op": "get", "GBps": nbytes / get_ms / 1e6}]


def run_redis(total_mib: int = 256, sizes_mib: tuple[int, ...] = (1, 4), repeat: int = 3) -> dict:
    """Ceilings, then rows for one instance (raw and zstd) and the 3-master cluster (raw)."""
    reason = missing_binaries()
    if reason:
        return {"skipped": f"redis part skipped: {reason}"}
    nbytes = total_mib << 20
    ceilings = {"socket_GBps": socket_ceiling_GBps(), "fresh_copy_GBps": fresh_copy_ceiling_GBps(nbytes),
                "memcpy_GBps": {size: memcpy_ceiling_GBps(nbytes, size << 20) for size in sizes_mib}}
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-redis-") as tmp:
        for target in ("single", "cluster"):
            server = RedisServer(f"{tmp}/single") if target == "single" else RedisCluster(f"{tmp}/cluster")
            try:
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
