from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eviction.select import SeqWindow, cdiv, select


def _brute_force(scores: torch.Tensor, protected: torch.Tensor, k: int) -> list[set[int]]:
    """Per head: protected blocks plus the best others by a plain sort."""
    rows = []
    for row in scores.tolist():
        others = sorted((i for i in range(len(row)) if not protected[i]), key=lambda i: -row[i])
        chosen = {i for i in range(len(row)) if protected[i]}
        rows.append(chosen | set(others[: k - len(chosen)]))
    return rows


def test_protected_range_counts_partial_blocks() -> None:
    # 100 tokens of 16: 7 blocks, the last holding 4 tokens.
    assert SeqWindow(num_tokens=100, block_tokens=16, sink_tokens=20, recent_tokens=30).protected_range() == (2, 4)
    assert SeqWindow(num_tokens=100, block_tokens=16, sink_tokens=0, recent_tokens=0).protected_range() == (0, 6)
    assert SeqWindow(num_tokens=100, block_tokens=16, sink_tokens=500, recent_tokens=500).protected_range() == (7, 0)
    mask = SeqWindow(num_tokens=100, block_tokens=16, sink_tokens=16, recent_tokens=4).protected_mask()
    assert mask.tolist() == [True, False, False, False, False, False, True]
    mask = SeqWindow(num_tokens=100, block_tokens=16, sink_tokens=17, recent_tokens=5).protected_mask()
    assert mask.tolist() == [True, True, False, False, False, True, True]  # token 95 is in block 5


@pytest.mark.parametrize(
    "num_kv_heads,num_tokens,block_tokens,sink,recent,budget",
    [(3, 1000, 16, 64, 200, 400), (1, 37, 4, 5, 9, 20), (8, 4097, 32, 0, 0, 96), (2, 515, 8, 7, 1, 0)],
)
def test_select_keeps_protected_and_best(num_kv_heads, num_tokens, block_tokens, sink, recent, budget) -> None:
    torch.manual_seed(num_tokens)
    num_blocks = cdiv(num_tokens, block_tokens)
    scores = torch.randn(num_kv_heads, num_blocks)
    window = SeqWindow(num_tokens=num_tokens, block_tokens=block_tokens, sink_tokens=sink, recent_tokens=recent)
    chosen = select(scores, window, budget_tokens=budget)
    k = window.num_selected(budget)
    assert chosen.dtype == torch.int64 and tuple(chosen.shape) == (num_kv_heads, k)
    assert bool((chosen[:, 1:] > chosen[:, :-1]).all()), "rows must be strictly ascending"
    assert bool((chosen[:, -1] == num_blocks - 1).all()), "the partial tail block must come last"
    expected = _brute_force(scores, window.protected_mask(), k)
    assert [set(row) for row in chosen.tolist()] == expected


def test_budget_covering_everything_returns_every_block() -> None:
    scores = torch.randn(4, 13)
    for budget in (13 * 8, 10_000):
        chosen = select(scores, SeqWindow(num_tokens=100, block_tokens=8), budget_tokens=budget)
        assert chosen.tolist() == [list(range(13))] * 4


def test_protected_blocks_survive_hostile_scores() -> None:
    scores = torch.full((2, 20), float("inf"))
    scores[:, 0] = float("nan")  # a sink block
    scores[:, 19] = float("-inf")  # the tail block
    scores[1, 5] = float("nan")
    window = SeqWindow(num_tokens=160, block_tokens=8, sink_tokens=8, recent_tokens=8)
    chosen = select(scores, window, budget_tokens=40)
    assert chosen.shape == (2, 5)
    assert bool((chosen[:, 0] == 0).all()) and bool((chosen[:, -1] == 19).all())
    assert 5 not in chosen[1].tolist()  # NaN ranks last


@settings(max_examples=60, deadline=None)
@given(
    num_tokens=st.integers(1, 600),
    block_tokens=st.sampled_from([1, 4, 16, 32]),
    sink=st.integers(0, 100),
    recent=st.integers(0, 200),
    budget=st.integers(0, 700),
    num_kv_heads=st.integers(1, 4),
)
def test_select_invariants(num_tokens, block_tokens, sink, recent, budget, num_kv_heads) -> None:
    window = SeqWindow(num_tokens=num_tokens, block_tokens=block_tokens, sink_tokens=sink, recent_tokens=recent)
    num_blocks = cdiv(num_tokens, block_tokens)
    chosen = select(torch.rand(num_kv_heads, num_blocks), window, budget_tokens=budget)
    protected = window.protected_mask().nonzero().flatten().tolist()
    for row in chosen.tolist():
        assert row == sorted(set(row)) and row[-1] == num_blocks - 1
        assert set(protected) <= set(row)
        assert len(row) == min(num_blocks, max(len(protected), budget // block_tokens))


@pytest.mark.parametrize(
    "scores,kwargs,message",
    [
        (torch.rand(2, 4), dict(budget_tokens=-1), "budget_tokens"),
        (torch.rand(2, 5), dict(), "expected 4 blocks"),
        (torch.rand(8), dict(), "kv_heads, num_blocks"),
        (torch.arange(8).view(2, 4), dict(), "float"),
        (torch.rand(2, 4), dict(num_tokens=0), "num_tokens"),
        (torch.rand(2, 4), dict(block_tokens=0), "block_tokens"),
        (torch.rand(2, 4), dict(sink_tokens=-3), "sink_tokens"),
        (torch.rand(2, 4), dict(budget_tokens=8.0), "budget_tokens"),
    ],
)
def test_select_rejects_bad_input(scores, kwargs, message) -> None:
    args = dict(num_tokens=30, block_tokens=8, budget_tokens=16, sink_tokens=0, recent_tokens=0) | kwargs
    budget = args.pop("budget_tokens")
    with pytest.raises(ValueError, match=message):
        select(scores, SeqWindow(**args), budget_tokens=budget)


def test_select_rejects_counts_that_are_not_a_window() -> None:
    with pytest.raises(ValueError, match="window: expected a SeqWindow, got dict"):
        select(torch.rand(2, 4), dict(num_tokens=30, block_tokens=8), budget_tokens=16)
    with pytest.raises(TypeError):
        SeqWindow(30, 8)  # keywords only: four ints in a row are easy to swap
