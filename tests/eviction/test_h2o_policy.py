from __future__ import annotations

import pytest
import torch

from eviction import H2O, H2OAccumulator, ScoreContext, coldest, h2o_evict
from eviction.select import cdiv, protected_mask


def _step_mass(num_kv_heads: int, num_blocks: int, heavy: list[int], g: torch.Generator) -> torch.Tensor:
    """One decode step's attention mass per block: softmax-like rows, heavy blocks get most of it."""
    logits = torch.randn(num_kv_heads, num_blocks, generator=g)
    logits[:, heavy] += 4.0
    return torch.softmax(logits, dim=1)  # [H, N], rows sum to 1


def test_accumulator_sums_dense_and_sparse_mass_and_grows() -> None:
    g = torch.Generator().manual_seed(0)
    acc = H2OAccumulator(num_kv_heads=3, capacity_blocks=4)
    expected = torch.zeros(3, 0)
    for num_blocks in (3, 3, 7, 11, 12):
        mass = torch.rand(3, num_blocks, generator=g)
        acc.add(mass)
        expected = torch.nn.functional.pad(expected, (0, num_blocks - expected.shape[1])) + mass
    ids = torch.stack([torch.randperm(14, generator=g)[:5] for _ in range(3)])  # [H, 5] sparse step over 14 blocks
    mass = torch.rand(3, 5, generator=g)
    acc.add(mass, ids, num_blocks=14)
    expected = torch.nn.functional.pad(expected, (0, 2)).scatter_add(1, ids, mass)
    assert acc.num_blocks == 14 and acc.scores.shape == (3, 14)
    torch.testing.assert_close(acc.scores, expected)
    with pytest.raises(ValueError, match="block_mass"):
        acc.add(torch.rand(2, 14))
    with pytest.raises(ValueError, match="block_ids"):
        acc.add(mass, ids.int(), num_blocks=14)


def test_drop_mode_keeps_heavy_hitters_sinks_and_recent() -> None:
    g = torch.Generator().manual_seed(1)
    block_tokens, num_kv_heads = 8, 2
    heavy = [5, 9, 23, 31]
    acc = H2OAccumulator(num_kv_heads)
    dropped: list[int] = []
    keep_tokens = 12 * block_tokens
    counts = dict(block_tokens=block_tokens, sink_tokens=8, recent_tokens=16)
    for num_tokens in range(8, 401, 8):  # one new block per 8 decode steps
        num_blocks = cdiv(num_tokens, block_tokens)
        mass = _step_mass(num_kv_heads, num_blocks, [b for b in heavy if b < num_blocks], g)
        mass[:, dropped] = 0.0  # dropped blocks are never attended again
        acc.add(mass)
        dropped += h2o_evict(acc.scores, num_tokens=num_tokens, keep_tokens=keep_tokens, dropped=dropped, **counts)
        assert num_blocks - len(dropped) == min(num_blocks, 12)
        assert len(set(dropped)) == len(dropped)
    live = sorted(set(range(50)) - set(dropped))
    assert set(heavy) <= set(live)
    protected = protected_mask(num_tokens=400, **counts).nonzero().flatten().tolist()
    assert set(protected) <= set(live) and protected == [0, 48, 49]


def test_h2o_policy_scores_select_and_evict() -> None:
    g = torch.Generator().manual_seed(2)
    scores = _step_mass(2, 30, [7, 12], g) + _step_mass(2, 30, [7, 12], g)  # [H, N]
    ctx = ScoreContext(torch.zeros(30, 2, 2, 16).half(), 240, 8, 8, 8, h2o_scores=scores)
    chosen = H2O().select(ctx, budget_tokens=4 * 8)
    assert [row[:1] + row[-1:] for row in chosen.tolist()] == [[0, 29], [0, 29]]
    assert all({7, 12} <= set(row) for row in chosen.tolist())
    evicted = H2O(head_reduce="sum").evict(ctx, keep_tokens=4 * 8)
    assert len(evicted) == 26 and not {0, 7, 12, 29} & set(evicted) and evicted == sorted(evicted)
    with pytest.raises(ValueError, match="h2o_scores"):
        H2O().select(ScoreContext(torch.zeros(30, 2, 2, 16).half(), 240, 8), budget_tokens=64)
    with pytest.raises(ValueError, match="dropped"):
        H2O().evict(ctx, keep_tokens=32, dropped=[29])
    with pytest.raises(ValueError, match="head_reduce"):
        H2O(head_reduce="mean")


def test_coldest_ranks_least_attended_first_and_never_protected() -> None:
    scores = torch.tensor([[5.0, 0.05, 3.0, 0.28, 9.0, 0.0], [1.0, 0.3, 2.0, 0.28, 9.0, 0.0]])
    protected = torch.tensor([False, False, False, False, False, True])
    assert coldest(scores, 3, protected) == [3, 1, 2]  # max over heads: 0.28, 0.3, 3.0
    assert coldest(scores, 2, protected, head_reduce="sum") == [1, 3]  # sums: 0.35, 0.56
    assert coldest(scores[0], 1) == [5]
    with pytest.raises(ValueError, match="n: expected"):
        coldest(scores, 6, protected)
    with pytest.raises(ValueError, match="protected"):
        coldest(scores, 1, protected[:5])
