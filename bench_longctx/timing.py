"""Timing and ceilings shared by the benchmarks: medians, device sync, environment."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, repeat: int = 5, warmup: int = 1) -> float:
    """Median wall time of fn() over `repeat` runs, the device synchronized around each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_ceiling(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes read + written per second by a large same-device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src), device)


def host_to_device_ceiling(device: torch.device, nbytes: int = 1 << 30) -> dict[str, float]:
    """Pinned host <-> device copy bandwidth (one large copy each way)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).random_()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = nbytes / median_seconds(lambda: dev.copy_(host, non_blocking=True), device)
    d2h = nbytes / median_seconds(lambda: host.copy_(dev, non_blocking=True), device)
    return {"pinned_h2d_GBps": h2d / 1e9, "pinned_d2h_GBps": d2h / 1e9}


def disk_ceiling(directory: str, nbytes: int = 256 << 20) -> dict[str, float]:
    """Sequential write+fsync and read-back of one file (the read may come from the page cache)."""
    data = os.urandom(1 << 20) * (nbytes >> 20)
    with tempfile.NamedTemporaryFile(dir=directory) as f:
        start = time.perf_counter()
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        write_s = time.perf_counter() - start
        f.seek(0)
        start = time.perf_counter()
        while f.read(16 << 20):
            pass
        read_s = time.perf_counter() - start
    return {"disk_write_fsync_GBps": nbytes / write_s / 1e9, "disk_read_GBps": nbytes / read_s / 1e9}


def environment(device: torch.device) -> dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "device": str(device),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    else:
        env["device_name"] = platform.processor() or platform.machine()
    return env
