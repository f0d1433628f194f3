"""The one timer and the one set of ceilings every suite and script of bench_longctx reads its numbers by.

    time_ms    median ms of a call that can repeat: triton's do_bench on CUDA (L2 flushed before
               every run), the wall clock around synchronized runs on CPU
    timed      one call's result and wall seconds, the device synchronized around it, for what
               cannot repeat (an SSD write, a run of decode steps, one request)
    ceilings   what bounds each move, measured in the same run: same-device copy, pinned
               host <-> device copy, disk write+fsync / read, host memcpy in given pieces,
               host copy into fresh memory, loopback TCP socket
    rate       one case's time read against the copy ceiling and a baseline
    GcPauses   the garbage collector's pauses while a block runs (what a long token may have waited for)
    Deadline, release, environment   a run's time budget, memory between cases, provenance
    write_json     a standalone script's result file
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
from typing import Callable, TypeVar

import numpy as np
import torch

T = TypeVar("T")
_CPU = torch.device("cpu")


def sync(device: torch.device | str | None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], T], device: torch.device | str | None = None) -> tuple[T, float]:
    """fn()'s result and the wall seconds it took, the device synchronized before and after."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def timed_calls(fn: Callable[[], T], log: list[tuple[float, T]]) -> Callable[[], T]:
    """fn, appending (wall seconds, result) of every call to `log` (no device sync: what the caller waits)."""
    def wrapper() -> T:
        started = time.perf_counter()
        out = fn()
        log.append((time.perf_counter() - started, out))
        return out
    return wrapper


class GcPauses:
    """Records every garbage collection between start() and stop() (or in a `with` block), on any thread (a
    collection holds the GIL: every thread waits for it): `pauses` holds (generation, perf_counter at its start,
    seconds)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float, float]] = []
        self._started: float | None = None

    def start(self) -> GcPauses:
        gc.callbacks.append(self._observe)
        return self

    def stop(self) -> None:
        if self._observe in gc.callbacks:
            gc.callbacks.remove(self._observe)

    def __enter__(self) -> GcPauses:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _observe(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.pauses.append((info["generation"], self._started, time.perf_counter() - self._started))
            self._started = None

    def within(self, start: float, end: float) -> float:
        """Seconds of collections that overlapped [start, end] (perf_counter)."""
        return sum(min(end, t + s) - max(start, t) for _, t, s in self.pauses if t < end and t + s > start)

    def summary(self) -> dict:
        full = [s for g, _, s in self.pauses if g == 2]
        return {"collections": len(self.pauses), "full_collections": len(full),
                "longest_s": max((s for _, _, s in self.pauses), default=0.0), "longest_full_s": max(full, default=0.0),
                "total_s": sum(s for _, _, s in self.pauses)}


def time_ms(fn: Callable[[], object], device: torch.device | str, repeat: int = 5, warmup: int = 1) -> float:
    """Median milliseconds of fn(): do_bench on CUDA; on CPU `warmup` untimed runs, then `repeat` timed ones."""
    if torch.device(device).type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    for _ in range(warmup):
        fn()
    return 1e3 * statistics.median(timed(fn)[1] for _ in range(repeat))


def copy_ceiling_GBps(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes read + written per second (GB/s) by one large same-device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / time_ms(lambda: dst.copy_(src), device) / 1e6


def host_device_ceilings(device: torch.device, nbytes: int = 1 << 30) -> dict[str, float]:
    """Pinned host <-> device copy bandwidth, GB/s (one large copy each way)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).random_()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = time_ms(lambda: dev.copy_(host, non_blocking=True), device)
    d2h = time_ms(lambda: host.copy_(dev, non_blocking=True), device)
    return {"pinned_h2d_GBps": nbytes / h2d / 1e6, "pinned_d2h_GBps": nbytes / d2h / 1e6}


def disk_ceiling(directory: str, nbytes: int = 256 << 20) -> dict[str, float]:
    """Sequential write+fsync and read-back of one file (the read may come from the page cache)."""
    data = os.urandom(1 << 20) * (nbytes >> 20)

    def write(f) -> None:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())

    def read(f) -> None:
        f.seek(0)
        while f.read(16 << 20):
            pass

    with tempfile.NamedTemporaryFile(dir=directory) as f:
        _, write_s = timed(lambda: write(f))
        _, read_s = timed(lambda: read(f))
    return {"disk_write_fsync_GBps": nbytes / write_s / 1e9, "disk_read_GBps": nbytes / read_s / 1e9}


def _host_bytes(nbytes: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)


def memcpy_ceiling_GBps(nbytes: int, chunk: int, repeat: int = 3) -> float:
    """Single-threaded host copy of nbytes in `chunk`-byte pieces into a preallocated, touched buffer:
    what a loopback request moving the same pieces is read against."""
    src, dst = _host_bytes(nbytes), np.ones(nbytes, dtype=np.uint8)

    def copy() -> None:
        for offset in range(0, nbytes, chunk):
            np.copyto(dst[offset: offset + chunk], src[offset: offset + chunk])

    return nbytes / time_ms(copy, _CPU, repeat) / 1e6


def fresh_copy_ceiling_GBps(nbytes: int, repeat: int = 3) -> float:
    """Host copy into a newly allocated buffer each run (the allocation and its first-touch page faults
    timed): what any read that returns new memory pays."""
    src = _host_bytes(nbytes)

    def copy() -> None:
        np.copyto(torch.empty(nbytes, dtype=torch.uint8).numpy(), src)

    return nbytes / time_ms(copy, _CPU, repeat) / 1e6


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


def rate(ms: float, nbytes: int, ceiling_GBps: float, baseline_ms: float) -> dict:
    """One measured case: time, bytes it must read, achieved GB/s, its share of the copy ceiling, speedup."""
    gbps = nbytes / ms / 1e6
    return {"ms": ms, "bytes": nbytes, "GBps": gbps, "of_copy_ceiling": gbps / ceiling_GBps,
            "speedup_vs_sdpa": baseline_ms / ms}


def release(device: torch.device) -> None:
    """Give freed tensors back before the next case allocates (1M-token stores are GBs)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Deadline:
    """Cases not started before the preset's time budget are skipped, so one run fits one device call."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def expired(self) -> bool:
        return self.remaining() <= 0


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


def write_json(directory: str, name: str, result: dict) -> str:
    """Write `result` to directory/name (creating the directory); returns the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path
