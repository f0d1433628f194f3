from __future__ import annotations

import torch

from bench_longctx.needle_selection import run as run_needles, table as needle_table
from bench_longctx.presets import NeedlePreset
from bench_longctx.selection_quality import evaluate, table
from eviction.cascade import CascadeTopK


def test_cascade_rows_beside_quest():
    g = torch.Generator().manual_seed(0)
    steps, tokens = 2, 515  # a partial tail block
    keys = [(torch.randn(tokens, 2, 16, generator=g) * 2).half() for _ in range(2)]  # [T, H, D] per layer
    queries = [(torch.randn(steps, 4, 16, generator=g) * 2).half() for _ in range(2)]  # [S, Hq, D]
    result = evaluate(keys, queries, ["quest", "cascade", "cascade_raw"], (16,), (8,),
                      cascade=CascadeTopK(candidate_factor=2))
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"oracle", "quest", "cascade", "cascade_raw"}
    for r in rows.values():
        assert 0.0 < r["worst_vs_oracle"] <= r["worst_layer_vs_oracle"] <= r["mean_vs_oracle"] <= 1.0 + 1e-6
    checks = {c["method"]: c for c in result["cascade"]}
    assert set(checks) == {"cascade", "cascade_raw"}
    for c in checks.values():
        assert 0.0 <= c["mean_survivor_fraction"] <= c["max_survivor_fraction"] <= 1.0
        assert c["candidate_factor"] == 2 and 0.0 <= c["complete_fraction"] <= 1.0
    assert "| cascade_raw | 16 | 1/8 |" in table(result)


def test_needle_selection_rows():
    rows = run_needles((4096,), 1, NeedlePreset(budgets=(1024,)))
    by = {r["selector"]: r for r in rows}
    assert set(by) == {"quest", "sketch", "cascade", "cascade_c16", "cascade_raw", "cascade_raw_c16"}
    assert len({r["trials"] for r in rows}) == 1 and rows[0]["trials"] > 0  # the same needles for each selector
    assert by["cascade"]["found"] == by["cascade"]["trials"] and by["cascade"]["weight_held"] > 0.99
    assert by["quest"]["found"] < by["cascade"]["found"]
    assert "| 4096 | 1024 |" in needle_table(rows)
