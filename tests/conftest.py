"""Without a GPU, Triton kernels run under the interpreter (set before triton is imported), and tests
marked `cuda` are skipped. Under pytest-xdist each worker runs torch on one thread."""

from __future__ import annotations

import gc
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `-n 2` (the README's command): one worker per core; a worker's torch
    torch.set_num_threads(1)  # threads would spin against the other's (most tests are single-threaded Python)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` need a GPU: without one they are skipped, not failed."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked cuda)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """On a GPU, what a test's stores, decoders and captured graphs hold (GiBs, often in reference cycles) is
    collected and handed back before the next test, so a module's tests do not run the device out of memory."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
