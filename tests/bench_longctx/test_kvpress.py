"""kvpress beside kvtier in the quality bench: the runner's request format, the checks on its settings, and
(where a kvpress environment exists) its dense row against kvtier's on the same tokens."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from bench_longctx import kvpress_runner
from bench_longctx.cli import main
from bench_longctx.models import Models
from bench_longctx.presets import QualityPreset, get_preset, override
from bench_longctx.timing import Deadline

# the python of a virtual environment with kvpress (docs/benchmarks.md), named by KVTIER_KVPRESS_PYTHON; absent in CI
KVPRESS_PYTHON = os.environ.get("KVTIER_KVPRESS_PYTHON", "")


def test_a_request_round_trips_through_the_runner_files(tmp_path, monkeypatch):
    req = kvpress_runner.request("/models/m.gguf", ["snapkv", "knorm"], [8, 16], threads=2,
                                 prefix_ids=list(range(40)), scored_ids=[5, 6, 7],
                                 passkey=[{"key": [512, 0.5, "12345"], "context_ids": [1, 2], "question_ids": [3]}])
    assert json.loads(json.dumps(req)) == req
    assert req["perplexity"] == {"prefix_ids": list(range(40)), "scored_ids": [5, 6, 7]}
    result = {"versions": {"kvpress": "0"}, "perplexity": [{"press": "dense", "budget": None, "ppl": 3.5}],
              "passkey": [{"key": [512, 0.5, "12345"], "press": "knorm", "budget": 8, "answer_ids": [9]}]}
    seen = []
    monkeypatch.setattr(kvpress_runner, "serve", lambda r: seen.append(r) or result)
    (tmp_path / "req.json").write_text(json.dumps(req))
    assert kvpress_runner.main([str(tmp_path / "req.json"), str(tmp_path / "out.json")]) == 0
    assert seen == [req] and json.loads((tmp_path / "out.json").read_text()) == result


@pytest.mark.parametrize("presses, budgets, scored, match", [
    (["snapkv", "nope"], [8], [1, 2], "kvpress_presses must be"),
    (["snapkv"], [40], [1, 2], "budgets must lie in"),
    (["snapkv"], [8], [1], "at least 2 scored"),
])
def test_a_request_refuses_what_the_runner_cannot_run(presses, budgets, scored, match):
    with pytest.raises(ValueError, match=match):
        kvpress_runner.request("m.gguf", presses, budgets, prefix_ids=list(range(40)), scored_ids=scored)


def test_the_bench_refuses_a_kvpress_python_that_does_not_exist(tmp_path, capsys):
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    for section in ("quality", "passkey"):
        with pytest.raises(ValueError, match=f"{section}.kvpress_python .*no such executable"):
            override(get_preset("quick"), f"{section}.kvpress_python={missing}")
    with pytest.raises(ValueError, match="quality.kvpress_presses must be"):
        override(get_preset("quick"), "quality.kvpress_presses=snapkv,h2o")
    assert main(["bench", "quality", "--set", f"quality.kvpress_python={missing}", "--out", str(tmp_path)]) == 2
    assert "kvpress_python" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no such executable"):
        kvpress_runner.run(missing, {})
    assert get_preset("quick").quality.kvpress_python == ""  # off unless asked for


@pytest.mark.skipif(not KVPRESS_PYTHON or not Path(KVPRESS_PYTHON).is_file(),
                    reason="KVTIER_KVPRESS_PYTHON names no kvpress environment's python")
def test_kvpress_dense_matches_kvtier_dense_on_the_same_tokens():
    from bench_longctx.quality import run_quality

    models = Models(torch.device("cpu"))
    if models.note():
        pytest.skip(models.note())
    p = QualityPreset(prefill_tokens=64, prefix_tokens=256, scored_tokens=8, budgets=(64,), modes="topk",
                      selection_tokens=0, kvpress_python=KVPRESS_PYTHON, kvpress_presses="streaming_llm")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the quick preset runs: on a small shared CPU more threads spin against others
    try:
        r = run_quality(p, torch.device("cpu"), models, Deadline(600), lambda items, _: items)
    finally:
        torch.set_num_threads(threads)
    assert "error" not in r["kvpress"], r["kvpress"]
    rows = {(x["store"], x["mode"]): x for x in r["decode"]["rows"]}
    dense, streaming = rows[("kvpress", "kvpress:dense")], rows[("kvpress", "kvpress:streaming_llm")]
    kvtier = rows[("fp16", "dense")]["ppl"]
    assert abs(dense["ppl"] / kvtier - 1) < 0.01  # fp32 model both sides; kvtier's K/V are fp16
    assert r["kvpress"]["dense_difference"] == pytest.approx(dense["ppl"] - kvtier)
    assert streaming["kept_tokens"] == 64 and streaming["budget"] == 64 and dense["kept_tokens"] == 256
    assert streaming["relative_vs_own_dense"] == pytest.approx(streaming["ppl"] / dense["ppl"] - 1)
