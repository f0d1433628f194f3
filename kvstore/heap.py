"""The process heap and Python's garbage collector, for a process that serves tokens.

A full collection walks every container object the process holds. A process with torch, triton and a model
loaded holds a few hundred thousand, and a full collection of them took 175-216 ms on a 2-core host, on
whichever thread allocated last (it holds the GIL: every thread waits). Decoding triggers one every so often,
and a background save's writer thread allocates enough to trigger them more often: those collections were the
longest tokens while saving (BENCHMARKS.md, Saving while decoding).

`freeze_heap()` collects once, then moves every object left into the collector's permanent generation
(`gc.freeze`): later collections walk only what was allocated since. A serving process calls it when its model,
store and kernels are loaded, before it serves (`kvtier generate` does, and the serving benchmarks before each
timed run; an engine driving `engine_adapter.Decoder` or a `Scheduler` itself calls it likewise). What it costs: objects frozen are freed by reference
counting as before, but a reference cycle among them is never collected, so call it once the long-lived state
exists, not in a loop.
"""

from __future__ import annotations

import gc


def freeze_heap() -> int:
    """Collect, then freeze every object the process holds (module docstring); returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
