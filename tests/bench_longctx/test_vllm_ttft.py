"""`kvtier bench vllm` without vLLM: its arguments, and the summary it computes from measured runs
(the engines themselves run in tests/engine_adapter/test_vllm_connector.py's environment)."""

from __future__ import annotations

import pytest

from bench_longctx.cli import main
from bench_longctx.vllm_ttft import summarize


def test_vllm_suite_needs_a_model_folder(capsys):
    assert main(["bench", "vllm"]) == 2
    assert "--model" in capsys.readouterr().err


def test_summary_ratios_come_from_the_runs():
    runs = {"no_connector": {"seconds": [40.0, 38.0, 44.0], "cached": [0, 0, 0]},
            "kvtier": {"seconds": [1.5, 1.0, 1.2], "cached": [4096] * 3, "bytes": 3 * 94_371_840.0},
            "lmcache": {"seconds": [2.0, 3.0, 2.4], "cached": [4096] * 3}}
    out = summarize(4096, runs)
    assert out["median_ttft_s"] == {"no_connector": 40.0, "kvtier": 1.2, "lmcache": 2.4}
    assert out["speedup_vs_recompute"] == pytest.approx({"kvtier": 40.0 / 1.2, "lmcache": 40.0 / 2.4})
    assert out["kvtier_over_lmcache_ttft"] == pytest.approx(0.5)
    assert out["kvtier_bytes_per_request"] == 94_371_840.0
    assert out["kvtier_GBps_over_ttft"] == pytest.approx(94_371_840.0 / 1.2 / 1e9)
    runs["lmcache"] = {"not_measured": "no --lmcache-python"}
    assert "kvtier_over_lmcache_ttft" not in summarize(4096, runs)
