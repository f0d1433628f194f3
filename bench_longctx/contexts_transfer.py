"""Save and load of a context against the disk's and PCIe's ceilings, measured in the same run.

    save   store.save of a filled context into its ssd_path: GB/s of the values written (block values and
           summaries, codes, scores: the LMDB file) against this disk's write + fsync ceiling
    load   a new store opens it with the LMDB file out of the page cache (posix_fadvise DONTNEED: what a
           restart reads) and store.load moves every block into the tiers: GB/s of the block values read
           against min(disk read ceiling, pinned host-to-device copy) (the latter on CUDA only)
    ceilings  a file as large as the save, written in 64 MiB chunks and fsynced (the better of: one fsync at
           the end; fdatasync in a second thread while writing), dropped from the page cache and read back;
           256 MiB pinned host -> device copies
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from bench_longctx.timing import timed
from kvstore.config import Config
from kvstore.store import KVStore

_CHUNK = 64 << 20
GOAL = 0.8  # of the ceiling


def drop_cache(path: str) -> None:
    """Evict a file's clean pages from the page cache (no root needed; mapped pages stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_ceiling(path: str, nbytes: int, flush_behind: bool) -> float:
    """GB/s of writing `nbytes` to a new file and fsyncing it (with a flusher thread if `flush_behind`)."""
    buf, done = os.urandom(_CHUNK), threading.Event()
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)

    def flush() -> None:
        while not done.wait(0.02):
            os.fdatasync(fd)

    flusher = threading.Thread(target=flush, daemon=True) if flush_behind else None
    if flusher:
        flusher.start()
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, memoryview(buf)[:min(_CHUNK, left)])
        done.set()
        if flusher:
            flusher.join()
        os.fsync(fd)
    finally:
        os.close(fd)
    return nbytes / (time.perf_counter() - started) / 1e9


def read_ceiling(path: str) -> float:
    """GB/s of reading a file from disk (its pages dropped from the page cache first), 64 MiB at a time."""
    drop_cache(path)
    buf, total = bytearray(_CHUNK), 0
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            total += n
    return total / (time.perf_counter() - started) / 1e9


def h2d_ceiling(device: str) -> float | None:
    """GB/s of 256 MiB pinned host -> device copies (None off CUDA)."""
    if torch.device(device).type != "cuda":
        return None
    host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=device)
    dev.copy_(host, non_blocking=True)
    _, seconds = timed(lambda: [dev.copy_(host, non_blocking=True) for _ in range(8)], device)
    return 8 * host.numel() / seconds / 1e9


def ceilings(directory: str, nbytes: int, device: str) -> dict:
    path = str(Path(directory) / "ceiling.bin")
    try:
        end, behind = write_ceiling(path, nbytes, False), write_ceiling(path, nbytes, True)
        read = read_ceiling(path)
    finally:
        Path(path).unlink(missing_ok=True)
    return {"bytes": nbytes, "write_fsync_gb_per_s": max(end, behind), "write_one_fsync_gb_per_s": end,
            "write_flush_behind_gb_per_s": behind, "read_gb_per_s": read, "pinned_h2d_gb_per_s": h2d_ceiling(device)}


def run_transfer(config: Callable[[str], Config], fill: Callable, context: int, directory: str, device: str) -> dict:
    """Fill a context of `context` tokens, save it, reopen it with a cold page cache and load it all."""
    path = str(Path(directory) / "transfer")
    with KVStore(config(path)) as store:
        seq, _ = fill(store, context)
        _, save_s = timed(lambda: store.save(seq, "bench"), device)
        counts = dict(store.saved.blocks.counts)
    data = str(Path(path) / "data.mdb")
    saved_bytes = os.path.getsize(data)
    drop_cache(data)
    with KVStore(config(path)) as store:
        seq, open_s = timed(lambda: store.open("bench"), device)
        loaded, load_s = timed(lambda: store.load(seq), device)
    block_bytes = counts["bytes_written"] / max(1, counts["blocks_written"])
    shutil.rmtree(path)  # the ceiling's file takes its room: a disk may hold only one of the two
    ceiling = ceilings(directory, saved_bytes, device)
    save_gbps, load_gbps = saved_bytes / save_s / 1e9, loaded * block_bytes / load_s / 1e9
    read_bound = min(x for x in (ceiling["read_gb_per_s"], ceiling["pinned_h2d_gb_per_s"]) if x is not None)
    return {"context": context, "save_s": save_s, "saved_bytes": saved_bytes, **counts, "save_gb_per_s": save_gbps,
            "open_s": open_s, "blocks_loaded": loaded, "load_s": load_s, "load_gb_per_s": load_gbps,
            "ceilings": ceiling, "save_of_ceiling": save_gbps / ceiling["write_fsync_gb_per_s"],
            "load_of_ceiling": load_gbps / read_bound, "goal": GOAL}


def summary(t: dict) -> str:
    """run_transfer's result in one line."""
    c = t["ceilings"]
    h2d = "" if c["pinned_h2d_gb_per_s"] is None else f", pinned H2D {c['pinned_h2d_gb_per_s']:.1f} GB/s"
    return (f"transfer, {t['context']} tokens: save {t['saved_bytes'] / 1e9:.2f} GB in {t['save_s']:.1f} s = "
            f"{t['save_gb_per_s']:.2f} GB/s ({t['save_of_ceiling']:.0%} of write + fsync "
            f"{c['write_fsync_gb_per_s']:.2f} GB/s); load {t['blocks_loaded']} blocks in {t['load_s']:.1f} s = "
            f"{t['load_gb_per_s']:.2f} GB/s ({t['load_of_ceiling']:.0%} of disk read {c['read_gb_per_s']:.2f} GB/s"
            f"{h2d}); goal {t['goal']:.0%}")
