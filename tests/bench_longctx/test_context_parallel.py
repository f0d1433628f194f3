"""`python -m bench_longctx.context_parallel`: its arguments are checked before any rank starts (the run itself is
the multi-process decode tests/engine_adapter/test_context_parallel.py covers)."""

from __future__ import annotations

import pytest

from bench_longctx.context_parallel import parse


def test_arguments_are_checked() -> None:
    p = parse(["--ranks", "3", "--context", "4096", "--mode", "sketch", "--device", "cpu"])
    assert (p.ranks, p.context, p.mode, p.backend, p.budget) == (3, 4096, "sketch", "auto", 4096)
    for bad in (["--ranks", "0"], ["--context", "40", "--ranks", "2"], ["--steps", "0"], ["--mode", "h2o"]):
        with pytest.raises(SystemExit):
            parse(bad + ["--device", "cpu"])
