"""`kvtier bench tiers`: bandwidth per tier and per move against ceilings measured in the same run.

The measurements are bench_longctx.tiers_bench.run_tiers (and, where fastapi/uvicorn are
installed and the preset asks for it, bench_longctx.service_bench against a real sidecar);
this module reads them as one list of moves, each next to the ceiling that bounds it:

  memcpy    a large same-device copy, as payload bytes per second (copy_ceiling / 2, since
            copy_ceiling counts bytes read + written), for moves within a device
  pinned    pinned host -> device copy (CUDA only), for cpu -> device fetches
  disk      sequential write + fsync / read-back of one file, for the ssd tier
  memcpy (same pieces)  service_bench's single-threaded copy of the same values
  loopback socket  one TCP pair on 127.0.0.1, for redis put/get (durable puts: disk write+fsync);
                   result["redis"]["ceilings"] adds the C client (redis-benchmark), redis-py
                   alone, fresh-memory copy and memcpy, all from the same run
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import tempfile

import torch

from bench_longctx.presets import TiersPreset
from bench_longctx.tiers_bench import run_tiers


def _move(name: str, gbps: float, ceiling: str | None, ceiling_gbps: float | None, ratio: float | None = None) -> dict:
    """One move; ratio: compression ratio (bytes in / bytes stored) where the move compresses."""
    frac = gbps / ceiling_gbps if ceiling_gbps else None
    return {"move": name, "GBps": gbps, "ceiling": ceiling, "ceiling_GBps": ceiling_gbps, "of_ceiling": frac,
            "ratio": ratio}


def moves(raw: dict) -> list[dict]:
    c = raw["ceilings"]
    memcpy = c["copy_GBps"] / 2
    gpu = raw.get("gpu_tiers") or raw["hot_warm_on_cpu"]
    fetch, cuda = raw["cpu_fetch"], "pinned_h2d_GBps" in c
    h2d = ("pinned h2d", c["pinned_h2d_GBps"]) if cuda else ("memcpy", memcpy)
    out = [
        _move("hot put (fp16 blocks into the pool)", gpu["hot_put_GBps"], "memcpy", memcpy),
        _move("hot -> warm (int8 quantize, fp16 in)", gpu["int8_quantize_GBps_fp16_in"], "memcpy", memcpy),
        _move("warm -> hot (int8 dequantize, fp16 out)", gpu["int8_dequantize_GBps_fp16_out"], "memcpy", memcpy),
        _move("cpu gather + verify (scattered blocks)", fetch["cpu_gather_verify_only_GBps"], "memcpy", memcpy),
        _move("cpu -> device batched fetch", fetch["cpu_fetch_batched_GBps"], *h2d),
    ]
    if "cpu_fetch_per_block_copies_GBps" in fetch:
        out.append(_move("cpu -> device, one copy per block", fetch["cpu_fetch_per_block_copies_GBps"], *h2d))
    for mode, r in raw["ssd"].items():
        out.append(_move(f"ssd write, {mode} (fsync per put)", r["write_GBps"], "disk write+fsync",
                         c["disk_write_fsync_GBps"], r["ratio"]))
        out.append(_move(f"ssd read, {mode}", r["read_GBps"], "disk read", c["disk_read_GBps"]))
    for mode, r in raw["codec"].items():
        out.append(_move(f"codec encode, {mode} (1 thread)", r["encode_GBps"], None, None, r["ratio"]))
        out.append(_move(f"codec decode, {mode} (1 thread)", r["decode_GBps"], None, None))
    return out


def service_note(p: TiersPreset) -> str | None:
    if not p.service_sizes:
        return "service part skipped: the preset has no service sizes"
    missing = [m for m in ("fastapi", "uvicorn", "httpx") if importlib.util.find_spec(m) is None]
    return f"service part skipped: {', '.join(missing)} not installed" if missing else None


def run_service(p: TiersPreset) -> list[dict]:
    """Batched and single put/get through a real `kvtier serve` sidecar on loopback."""
    from bench_longctx import service_bench
    from tiers.remote.client import Client

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-service-") as tmp:
        server = service_bench.Server(tmp, "--cpu-bytes", str(4 * p.service_mib * len(p.service_sizes) << 20))
        try:
            with Client(server.url) as client, contextlib.redirect_stdout(io.StringIO()):
                return [r for size in p.service_sizes
                        for r in service_bench.bench_size(client, size, p.service_mib, max(1, p.service_mib // 2))]
        finally:
            server.stop()


def run_redis_part(p: TiersPreset, directory: str) -> dict:
    """Put/get through the redis tier on its own loopback servers (one instance, a 3-master cluster),
    their files in `directory` (the disk the disk ceiling measured)."""
    if not p.redis_mib:
        return {"skipped": "redis part skipped: the preset has redis_mib=0"}
    from bench_longctx.redis_bench import run_redis

    try:
        return run_redis(p.redis_mib, p.redis_sizes, directory=directory)
    except Exception as exc:  # like the sidecar: a failure is reported, the tier numbers kept
        return {"error": f"{type(exc).__name__}: {exc}"}


def redis_moves(redis: dict, disk_write_GBps: float) -> list[dict]:
    """Redis rows against the loopback socket; durable puts (appendfsync always) against disk write+fsync."""
    socket = redis.get("ceilings", {}).get("socket_GBps")
    out = []
    for r in redis.get("rows", []):
        name = f"redis {r['target']} {r['op']}, {r['value_bytes'] >> 20} MiB values, {r['compression']}"
        durable_put = r["target"] == "single-durable" and r["op"] == "put"
        ceiling = ("disk write+fsync", disk_write_GBps) if durable_put else ("loopback socket", socket)
        out.append(_move(name, r["GBps"], *ceiling, r["ratio"]))
    return out


def run_tiers_suite(p: TiersPreset, device: torch.device, directory: str) -> dict:
    """directory: where the ssd tier and the disk ceiling write (a scratch folder in it, removed after)."""
    with tempfile.TemporaryDirectory(prefix=".kvtier-tiers-", dir=directory) as scratch:
        raw = run_tiers(device, scratch, p.geometry, p.blocks, p.fetch, p.ssd_blocks,
                        ceiling_bytes=p.ceiling_bytes, disk_bytes=p.disk_bytes)
    raw.pop("environment", None)  # the run's environment is recorded once, at the top of results.json
    result = {"geometry": p.geometry, "ceilings": raw["ceilings"], "moves": moves(raw), "raw": raw}
    result["redis"] = run_redis_part(p, directory)
    result["moves"] += redis_moves(result["redis"], raw["ceilings"]["disk_write_fsync_GBps"])
    note = service_note(p)
    if note:
        result["service"] = {"skipped": note}
        return result
    try:
        rows = run_service(p)
    except Exception as exc:  # the sidecar is optional here: a failure is reported, the tier numbers kept
        result["service"] = {"error": f"{type(exc).__name__}: {exc}"}
        return result
    result["service"] = {"rows": rows}
    for r in rows:
        name = f"remote {r['op']} {r['mode']}, {r['value_bytes'] >> 10} KiB values"
        result["moves"].append(_move(name, r["gb_per_s"], "memcpy (same pieces)", r["memcpy_gb_per_s"]))
    return result
