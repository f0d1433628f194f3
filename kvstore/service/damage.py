"""Opening the sidecar's LMDB file whatever state it is in: healthy, or damaged and read-only.

Before LMDB touches the file, lmdbfile.check_file walks it without trusting a byte. A
clean walk (and every key a valid name) opens the usual SsdTier. Anything else starts the
service degraded: the values the walk could reach are served read-only from the file,
each still verified by its own checksums on every read; writes answer 503; /healthz,
/v1/stats and /metrics report the damage. `kvtier verify --copy-to` copies the intact
values to a fresh store (kvstore/service/verify.py).
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field

from kvstore.service.lmdbfile import LmdbFile
from tiers.remote.wire import WireError, check_key, check_namespace
from tiers.ssd import SsdTier
from tiers.layout import BlockLayout

PREFIX = b"v/"
REPAIR_HINT = "stop the sidecar, run `kvtier verify --data-dir <dir> --copy-to <new dir>`, then serve <new dir>"


class Degraded(RuntimeError):
    """A write to a store that runs read-only on a damaged file; the service answers 503."""


@dataclass
class Damage:
    """What the startup check found; empty when the file is healthy."""

    problems: list[str] = field(default_factory=list)
    damaged_values: int = 0  # invalid keys, plus entries the meta counts that the walk could not reach
    found_values: int = 0

    @property
    def read_only(self) -> bool:
        return bool(self.problems)

    def summary(self) -> dict:
        return {"problems": len(self.problems), "damaged_values": self.damaged_values,
                "intact_values": self.found_values, "first_problems": self.problems[:5], "repair": REPAIR_HINT}


def key_problem(lkey: bytes) -> str:
    """Why `lkey` cannot be a key this service wrote ('' when it can)."""
    try:
        if not lkey.startswith(PREFIX):
            raise WireError(f"it does not start with {PREFIX!r}")
        namespace, _, key = lkey[len(PREFIX):].decode().partition("/")
        check_namespace(namespace)
        check_key(key)
    except (UnicodeDecodeError, WireError) as exc:
        return f"stored key {lkey[:120]!r} is not a valid key ({exc}); skipped"
    return ""


def open_values(path: str, capacity_bytes: int, sync: bool) -> tuple[SsdTier | FrozenValues, Damage]:
    """The raw-value store at `path` (an LMDB directory) and the damage the startup check found."""
    if not os.path.exists(os.path.join(path, "data.mdb")):
        return _healthy(path, capacity_bytes, sync), Damage()
    file = LmdbFile(path)
    report = file.check()
    bad = {key: text for key in report.entries if (text := key_problem(key))}
    if report.clean and not bad:
        file.close()
        return _healthy(path, capacity_bytes, sync), Damage(found_values=len(report.entries))
    entries = {k: place for k, place in report.entries.items() if k not in bad}
    damage = Damage(report.problems + list(bad.values()), found_values=len(entries),
                    damaged_values=len(bad) + max(0, report.expected_entries - len(report.entries)))
    return FrozenValues(file, entries, capacity_bytes), damage


def _healthy(path: str, capacity_bytes: int, sync: bool) -> SsdTier:
    # SsdTier's block API is unused here (values go through put_values); its layout is a placeholder.
    return SsdTier(BlockLayout(1, 1, 1), path, capacity_bytes, sync=sync, key_prefix=PREFIX)


class FrozenValues:
    """SsdTier's raw-value API, read-only, over the values a check of a damaged file reached."""

    def __init__(self, file: LmdbFile, entries: dict[bytes, tuple[int, int]], capacity_bytes: int) -> None:
        self.file = file
        self.places = entries
        self.sizes = {key: length for key, (_, length) in entries.items()}
        self.sorted_keys = sorted(entries)
        self.capacity_bytes = capacity_bytes
        self.used_bytes = sum(self.sizes.values())
        self.on_commit = None  # nothing ever commits

    @property
    def num_blocks(self) -> int:
        return len(self.sizes)

    def get_values(self, keys: list[bytes]) -> list[bytes | None]:
        return [self.file.read(*self.places[k]) if k in self.places else None for k in keys]

    def scan_keys(self, prefix: bytes, after: bytes = b"", limit: int | None = None) -> list[bytes]:
        start = bisect.bisect_left(self.sorted_keys, prefix)
        if after:
            start = max(start, bisect.bisect_right(self.sorted_keys, after))
        out = []
        for key in self.sorted_keys[start:]:
            if not key.startswith(prefix) or (limit is not None and len(out) >= limit):
                break
            out.append(key)
        return out

    def put_values(self, keys: list[bytes], values: list[bytes]) -> None:
        raise Degraded(f"the store is read-only: its LMDB file is damaged; {REPAIR_HINT}")

    def delete_keys(self, keys: list[bytes]) -> None:
        self.put_values(keys, [])

    def close(self) -> None:
        self.file.close()

