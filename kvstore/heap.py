"""The process heap and Python's garbage collector, for a process that serves tokens.

A full collection walks every container object the process holds. A process with torch, triton and a model
loaded holds a few hundred thousand, and a full collection of them took 193-220 ms on a 2-core host and up to
233 ms on an H100's host, on whichever thread allocated last (it holds the GIL: every thread waits). Decoding
triggers one every so often, and a background save's writer thread allocates enough to trigger them more often:
those collections were the longest tokens while saving (BENCHMARKS.md, Saving while decoding).

`freeze_heap()` collects once, then moves every object left into the collector's permanent generation
(`gc.freeze`): later collections walk only what was allocated since. A serving process calls it when its model,
store and kernels are loaded, before it serves; an engine driving `engine_adapter.Decoder` or a `Scheduler` calls
it likewise. What it costs: objects frozen are freed by reference counting as before, but a reference cycle
among them is never collected (a store is one), so call it once the long-lived state exists, not in a loop.
`frozen_heap()` does the same for a `with` block and unfreezes when it ends, so what became garbage meanwhile
(a closed store) is collected again: what `kvtier generate` and the serving benchmarks use, whose code may run
inside a longer-lived process (the test suite).
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


def freeze_heap() -> int:
    """Collect, then freeze every object the process holds (module docstring); returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextmanager
def frozen_heap() -> Iterator[int]:
    """freeze_heap() for the block (yields how many objects are frozen); on leaving it, every frozen object
    joins the oldest generation again (gc.unfreeze: also those another freeze left)."""
    count = freeze_heap()
    try:
        yield count
    finally:
        gc.unfreeze()
