"""Sidecar fault run: one flipped byte at a time in the store's LMDB file; does it open, what does it serve?

    python -m bench_longctx.service_faults [--values 400] [--flips 3000] [--seed 0] [--out DIR]

Writes `--values` values (24 B - 9 KB: inline and overflow) through the service's own
storage (kvstore.service.storage.ServiceStorage) in commits of 40, deletes some, closes it.
Then, for each of `--flips` offsets (every byte of the live meta, branch and leaf pages
first, then a sample of the rest of the file), flips one bit in a copy of the file, opens
the storage the way the sidecar starts (it must not raise) and reads every key it lists
plus every key written. Counts: opened, degraded (read-only) starts, values served, and
damaged values served (a value whose bytes differ from any version written under its key:
must be 0). Prints and writes DIR/service_faults.json; exits 1 if any open failed or any
damaged value was served.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

from kvstore.service.lmdbfile import LmdbFile
from kvstore.service.metrics import ServiceMetrics
from kvstore.service.storage import NotFound, ServiceStorage
from tiers.base import IntegrityError
from tiers.remote.wire import Descriptor

SIZES = [24, 200, 900, 3000, 9000]


def build(data_dir: str, count: int, rng: random.Random) -> dict[str, set[bytes]]:
    """Every version written under each key (a damaged newest commit may fall back to the previous one)."""
    storage = ServiceStorage(data_dir, 0, 1 << 30, ServiceMetrics())
    written: dict[str, set[bytes]] = {}
    names = [f"k{i:05d}" for i in range(count)]
    for start in range(0, count, 40):
        batch = [(k, rng.randbytes(rng.choice(SIZES))) for k in names[start:start + 40]]
        storage.put("ns", [(k, Descriptor("uint8", (len(v),)), v, None) for k, v in batch])
        for k, v in batch:
            written.setdefault(k, set()).add(v)
    storage.delete("ns", names[5:count:17])
    storage.close()
    return written


def live_structure_offsets(env_dir: str, psize: int = 4096) -> list[int]:
    """Every byte of the metas and of the branch and leaf pages the current tree uses."""
    file = LmdbFile(env_dir)
    try:
        report = file.check()
        leaf_pages = {offset // psize for offset, length in report.entries.values() if offset % psize != 16}
        data = file.map
        pages = {0, 1} | leaf_pages
        pages |= {p for p in range(len(data) // psize) if struct.unpack_from("<H", data, p * psize + 10)[0] == 1}
    finally:
        file.close()
    return [p * psize + i for p in sorted(pages) for i in range(psize)]


def one_flip(good: str, work: str, offset: int, bit: int, written: dict[str, set[bytes]]) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(good, work)
    path = os.path.join(work, "values.lmdb", "data.mdb")
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ bit]))
    try:
        storage = ServiceStorage(work, 1 << 20, 1 << 30, ServiceMetrics())
    except Exception as exc:  # the finding this run exists to catch
        return {"opened": False, "error": f"{type(exc).__name__}: {exc}"}
    served = damaged = 0
    try:
        for key in sorted(set(storage.keys("ns", limit=100_000)[0]) | set(written)):
            try:
                (value,) = storage.get("ns", [key])
            except (IntegrityError, NotFound):
                continue
            served += 1
            damaged += bytes(value.payload) not in written.get(key, ())
        return {"opened": True, "degraded": storage.damage.read_only, "served": served, "damaged_served": damaged}
    finally:
        storage.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=400)
    parser.add_argument("--flips", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    root = tempfile.mkdtemp(prefix="kvtier-faults-")
    good, work = os.path.join(root, "good"), os.path.join(root, "work")
    written = build(good, args.values, rng)
    size = os.path.getsize(os.path.join(good, "values.lmdb", "data.mdb"))
    structural = live_structure_offsets(os.path.join(good, "values.lmdb"))
    rest = [o for o in rng.sample(range(size), min(size, args.flips)) if o not in set(structural)]
    offsets = (rng.sample(structural, min(len(structural), args.flips // 2)) + rest)[:args.flips]
    start, totals = time.perf_counter(), {"flips": 0, "opened": 0, "degraded": 0, "served": 0, "damaged_served": 0}
    failures = []
    for offset in offsets:
        result = one_flip(good, work, offset, 1 << rng.randrange(8), written)
        totals["flips"] += 1
        if not result["opened"]:
            failures.append((offset, result["error"]))
            continue
        totals["opened"] += 1
        for name in ("degraded", "served", "damaged_served"):
            totals[name] += int(result[name])
    shutil.rmtree(root, ignore_errors=True)
    summary = {**totals, "values": args.values, "file_bytes": size, "structural_bytes": len(structural),
               "open_failures": failures[:20], "seconds": round(time.perf_counter() - start, 1)}
    print(json.dumps(summary, indent=1))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, "service_faults.json").write_text(json.dumps(summary, indent=1))
    return 1 if failures or totals["damaged_served"] else 0


if __name__ == "__main__":
    sys.exit(main())
