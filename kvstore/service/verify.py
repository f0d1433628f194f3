"""`kvtier verify --data-dir D [--copy-to D2]`: check a sidecar's store; copy its intact values out.

Walks the LMDB file without trusting it (lmdbfile.py), then reads and verifies every value
it reaches: both checksums and the key it was written under (values.py). Prints a report;
exits 0 when nothing is damaged, 1 when anything is (after copying, if asked), 2 when the
store cannot be read at all or the arguments are wrong. `--copy-to` writes every intact
value, bytes unchanged, into a fresh store that `kvtier serve --data-dir D2` can serve.
Safe on a running sidecar: an LMDB read transaction pins the snapshot while it walks.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import ExitStack

import lmdb

from kvstore.service.damage import key_problem
from kvstore.service.lmdbfile import LmdbFile
from kvstore.service.values import ValueCodec
from tiers.base import IntegrityError
from tiers.layout import BlockLayout
from tiers.ssd import SsdTier

_BATCH_BYTES = 64 << 20  # values per commit when copying


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", required=True, help="the --data-dir of a kvtier sidecar")
    parser.add_argument("--copy-to", default=None, metavar="DIR",
                        help="copy every intact value into a fresh store in DIR (created; must hold no store yet)")
    parser.add_argument("--show", type=int, default=20, help="problems and damaged keys to print (default 20)")


def run(args: argparse.Namespace) -> int:
    source = os.path.join(args.data_dir, "values.lmdb")
    if not os.path.exists(os.path.join(source, "data.mdb")):
        print(f"kvtier verify: no sidecar store in {args.data_dir!r} (expected {source}/data.mdb)", file=sys.stderr)
        return 2
    target = os.path.join(args.copy_to, "values.lmdb") if args.copy_to else None
    if target and os.path.exists(os.path.join(target, "data.mdb")):
        print(f"kvtier verify: --copy-to {args.copy_to!r} already holds a store; give an empty directory",
              file=sys.stderr)
        return 2
    with ExitStack() as stack:
        _pin_snapshot(source, stack)
        file = LmdbFile(source)
        stack.callback(file.close)
        report = file.check()
        intact, damaged = _verify_values(file, report.entries)
        print(f"{source}/data.mdb: {file.size} bytes, txn {report.txnid}")
        print(f"structure: {len(report.problems)} problem(s)")
        for text in report.problems[:args.show]:
            print(f"  {text}")
        missing = max(0, report.expected_entries - len(report.entries))
        print(f"values: {len(intact)} intact, {len(damaged)} damaged, {missing} unreachable "
              f"(the meta counts {report.expected_entries})")
        for key, why in damaged[:args.show]:
            print(f"  {key[:120]!r}: {why}")
        if target:
            copied = _copy(file, report.entries, intact, target)
            print(f"copied {copied} intact values to {target}")
    clean = not report.problems and not damaged and not missing
    print("OK" if clean else "DAMAGED")
    return 0 if clean else 1


def _pin_snapshot(source: str, stack: ExitStack) -> None:
    """Hold an LMDB read transaction, if LMDB can open the file, so a live writer reuses no page we walk."""
    try:
        env = lmdb.open(source, readonly=True, max_readers=256)
    except lmdb.Error:
        return  # damaged past LMDB's own checks: then no sidecar is writing to it either
    stack.callback(env.close)
    txn = env.begin()
    stack.callback(txn.abort)


def _verify_values(file: LmdbFile, entries: dict[bytes, tuple[int, int]]) -> tuple[list[bytes], list[tuple]]:
    codec = ValueCodec()
    intact, damaged = [], []
    for key, (offset, length) in sorted(entries.items()):
        why = key_problem(key)
        if not why:
            try:
                codec.decode(file.read(offset, length), repr(key), key)
            except IntegrityError as exc:
                why = str(exc)
        (damaged.append((key, why)) if why else intact.append(key))
    return intact, damaged


def _copy(file: LmdbFile, entries: dict[bytes, tuple[int, int]], keys: list[bytes], target: str) -> int:
    total = sum(entries[k][1] for k in keys)
    tier = SsdTier(BlockLayout(1, 1, 1), target, capacity_bytes=max(2 * total, 1 << 30), key_prefix=b"v/")
    try:
        batch: list[bytes] = []
        size = 0
        for i, key in enumerate(keys):
            batch.append(key)
            size += entries[key][1]
            if size >= _BATCH_BYTES or i == len(keys) - 1:
                tier.put_values(batch, [file.read(*entries[k]) for k in batch])
                batch, size = [], 0
        return tier.num_blocks
    finally:
        tier.close()
