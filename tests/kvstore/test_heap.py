"""freeze_heap: what the process holds leaves the collector's walks; what is allocated later is still collected;
frozen_heap undoes it when its block ends; and the collector's pauses (bench_longctx.timing.GcPauses) are seen
from any thread."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from bench_longctx.timing import GcPauses
from kvstore.heap import freeze_heap, frozen_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_frozen_objects_leave_the_walks_and_later_cycles_are_still_collected():
    before = cycle()
    kept = Node()
    try:
        frozen = freeze_heap()
        assert before() is None  # collected first: freezing keeps no garbage of the moment
        assert frozen > 1000 and frozen == gc.get_freeze_count()
        assert not any(o is kept for o in gc.get_objects(generation=2))  # frozen: no collection walks it
        later = cycle()
        with GcPauses() as seen:
            gc.collect()
        assert later() is None
        assert seen.summary()["full_collections"] == 1 and seen.summary()["longest_full_s"] > 0
    finally:
        gc.unfreeze()  # the rest of the test process as it was
    assert gc.get_freeze_count() == 0


def test_frozen_heap_unfreezes_so_what_died_meanwhile_is_collected():
    """A cycle alive at the freeze and dropped inside the block (a store closed) outlives collections there, and
    is collected once the block has ended: the process is left as it was."""
    held = [Node()]
    held[0].other = held[0]
    ref = weakref.ref(held[0])
    with frozen_heap() as count:
        assert count > 1000 and gc.get_freeze_count() > 1000
        held.clear()
        gc.collect()
        assert ref() is not None  # frozen: no collection walks it
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None


def test_collections_on_another_thread_are_recorded_and_placed_in_time():
    with GcPauses() as seen:
        worker = threading.Thread(target=gc.collect)
        worker.start()
        worker.join()
    full = [p for p in seen.pauses if p[0] == 2]  # (starting a thread may also trigger a young collection)
    assert len(full) == 1
    (_, start, seconds), = full
    assert seen.within(start, start + seconds) == pytest.approx(seconds)
    assert seen.within(start + seconds + 1, start + seconds + 2) == 0
