"""What every suite of `kvtier bench` shares: a timer per device, a deadline, rates from measurements."""

from __future__ import annotations

import gc
import time
from typing import Callable

import torch

from bench_longctx.timing import median_seconds


def time_ms(fn: Callable[[], object], device: torch.device, repeat: int = 3) -> float:
    """Median milliseconds of fn(): triton's do_bench (L2 flushed per run) on CUDA, wall clock on CPU."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    return 1e3 * median_seconds(fn, device, repeat=repeat, warmup=1)


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
