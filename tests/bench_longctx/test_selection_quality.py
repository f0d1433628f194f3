from __future__ import annotations

import pytest
import torch

from bench_longctx.needle_selection import run as run_needles, table as needle_table
from bench_longctx.presets import NeedlePreset
from bench_longctx.selection_quality import evaluate, table
from eviction.cascade import CascadeTopK


def qk(seed: int = 0, tokens: int = 515) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Keys [T, H, D] and queries [S, Hq, D] of two layers, 2 steps; 515 tokens: a partial tail block."""
    g = torch.Generator().manual_seed(seed)
    steps = 2
    keys = [(torch.randn(tokens, 2, 16, generator=g) * 2).half() for _ in range(2)]
    queries = [(torch.randn(steps, 4, 16, generator=g) * 2).half() for _ in range(2)]
    return keys, queries


def test_cascade_rows_beside_quest():
    keys, queries = qk(tokens=2051)  # 1/8: k = 16 of 129 blocks, 9 protected; 2 x k candidates: 41
    result = evaluate(keys, queries, ["quest", "cascade", "cascade_raw"], (16,), (8,),
                      cascade=CascadeTopK(candidate_factor=2), candidate_factors=(2, 64))
    rows = {r["method"]: r for r in result["rows"]}
    cascades = {"cascade", "cascade_raw", "cascade_c64", "cascade_raw_c64"}
    assert set(rows) == {"oracle", "oracle_free", "quest"} | cascades | {c + "_ceiling" for c in cascades}
    assert rows["oracle_free"]["mean_vs_free_oracle"] == 1.0 and rows["oracle_free"]["mean_vs_oracle"] > 1.0
    for name, r in rows.items():
        if name != "oracle_free":  # the oracle picks the same count with the window protected
            assert 0.0 < r["worst_vs_oracle"] <= r["worst_layer_vs_oracle"] <= r["mean_vs_oracle"] <= 1.0 + 1e-6
            assert 0.0 < r["worst_layer_vs_free_oracle"] <= r["mean_vs_free_oracle"] <= 1.0 + 1e-6
    for c in cascades:  # a perfect ranking of the candidates keeps at least the cascade's mass, at most the oracle's
        assert rows[c]["mean_mass"] <= rows[c + "_ceiling"]["mean_mass"] + 1e-6
    # 64 x k candidates are every block: their ceiling is the oracle
    assert rows["cascade_raw_c64_ceiling"]["mean_vs_oracle"] == pytest.approx(1.0)
    assert rows["cascade_raw_ceiling"]["mean_vs_oracle"] < 1.0
    checks = {c["method"]: c for c in result["cascade"]}
    assert set(checks) == cascades
    for c in checks.values():
        assert 0.0 <= c["mean_survivor_fraction"] <= c["max_survivor_fraction"] <= 1.0
        assert c["candidate_factor"] == (64 if c["method"].endswith("_c64") else 2)
        assert 0.0 <= c["complete_fraction"] <= 1.0
    assert "| cascade_raw_c64 | 16 | 1/8 |" in table(result)


def test_a_larger_forced_window_costs_the_oracle_mass():
    """recent_tokens=None protects the store's recent window (an eighth of a 256-token budget here, 32 tokens): the
    oracle keeps more than with half the budget forced (128 recent tokens), and oracle_free does not change."""
    keys, queries = qk(seed=1)
    rows = {}
    for recent in (128, None):
        result = evaluate(keys, queries, ["quest"], (16,), (2,), recent_tokens=recent)
        assert result["recent_tokens"] == ("store" if recent is None else 128)
        rows[recent] = {r["method"]: r for r in result["rows"]}
    assert rows[128]["oracle"]["mean_mass"] < rows[None]["oracle"]["mean_mass"]
    assert rows[None]["oracle_free"]["mean_mass"] == rows[128]["oracle_free"]["mean_mass"]


def test_needle_selection_rows():
    rows = run_needles((4096,), 1, NeedlePreset(budgets=(1024,)))
    by = {r["selector"]: r for r in rows}
    assert set(by) == {"quest", "sketch", "cascade", "cascade_c16", "cascade_raw", "cascade_raw_c16"}
    assert len({r["trials"] for r in rows}) == 1 and rows[0]["trials"] > 0  # the same needles for each selector
    assert by["cascade"]["found"] == by["cascade"]["trials"] and by["cascade"]["weight_held"] > 0.99
    assert by["quest"]["found"] < by["cascade"]["found"]
    assert "| 4096 | 1024 |" in needle_table(rows)
