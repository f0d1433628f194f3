from __future__ import annotations

import pytest
import torch

from eviction import H2O, ScoreContext, SeqWindow, h2o_evict
from eviction.select import cdiv


def _step_mass(num_kv_heads: int, num_blocks: int, heavy: list[int], g: torch.Generator) -> torch.Tensor:
    """One decode step's attention mass per block: softmax-like rows, heavy blocks get most of it."""
    logits = torch.randn(num_kv_heads, num_blocks, generator=g)
    logits[:, heavy] += 4.0
    return torch.softmax(logits, dim=1)  # [H, N], rows sum to 1


def test_drop_mode_keeps_heavy_hitters_sinks_and_recent() -> None:
    g = torch.Generator().manual_seed(1)
    block_tokens, num_kv_heads = 8, 2
    heavy = [5, 9, 23, 31]
    scores = torch.zeros(num_kv_heads, 0)  # accumulated mass, as a store's table keeps it
    dropped: list[int] = []
    keep_tokens = 12 * block_tokens
    counts = dict(block_tokens=block_tokens, sink_tokens=8, recent_tokens=16)
    for num_tokens in range(8, 401, 8):  # one new block per 8 decode steps
        num_blocks = cdiv(num_tokens, block_tokens)
        mass = _step_mass(num_kv_heads, num_blocks, [b for b in heavy if b < num_blocks], g)
        mass[:, dropped] = 0.0  # dropped blocks are never attended again
        scores = torch.nn.functional.pad(scores, (0, num_blocks - scores.shape[1])) + mass
        dropped += h2o_evict(scores, SeqWindow(num_tokens=num_tokens, **counts), keep_tokens=keep_tokens,
                             dropped=dropped)
        assert num_blocks - len(dropped) == min(num_blocks, 12)
        assert len(set(dropped)) == len(dropped)
    live = sorted(set(range(50)) - set(dropped))
    assert set(heavy) <= set(live)
    protected = SeqWindow(num_tokens=400, **counts).protected_mask().nonzero().flatten().tolist()
    assert set(protected) <= set(live) and protected == [0, 48, 49]


def test_h2o_policy_scores_select_and_evict() -> None:
    g = torch.Generator().manual_seed(2)
    scores = _step_mass(2, 30, [7, 12], g) + _step_mass(2, 30, [7, 12], g)  # [H, N]
    window = SeqWindow(num_tokens=240, block_tokens=8, sink_tokens=8, recent_tokens=8)
    ctx = ScoreContext(torch.zeros(30, 2, 2, 16).half(), window, h2o_scores=scores)
    chosen = H2O().select(ctx, budget_tokens=4 * 8)
    assert [row[:1] + row[-1:] for row in chosen.tolist()] == [[0, 29], [0, 29]]
    assert all({7, 12} <= set(row) for row in chosen.tolist())
    evicted = H2O(head_reduce="sum").evict(ctx, keep_tokens=4 * 8)
    assert len(evicted) == 26 and not {0, 7, 12, 29} & set(evicted) and evicted == sorted(evicted)
    with pytest.raises(ValueError, match="h2o_scores"):
        H2O().select(ScoreContext(torch.zeros(30, 2, 2, 16).half(), SeqWindow(num_tokens=240, block_tokens=8)),
                     budget_tokens=64)
    with pytest.raises(ValueError, match="dropped"):
        H2O().evict(ctx, keep_tokens=32, dropped=[29])
    with pytest.raises(ValueError, match="head_reduce"):
        H2O(head_reduce="mean")


def test_block_worth_ranks_demotion_victims() -> None:
    scores = torch.tensor([[5.0, 0.05, 3.0, 0.28, 9.0, 0.0], [1.0, 0.3, 2.0, 0.28, 9.0, 0.0]])
    assert H2O().block_worth(scores).tolist() == pytest.approx([5.0, 0.3, 3.0, 0.28, 9.0, 0.0])  # max over heads
    assert H2O(head_reduce="sum").block_worth(scores).tolist() == pytest.approx([6.0, 0.35, 5.0, 0.56, 18.0, 0.0])
    with pytest.raises(ValueError, match="scores"):
        H2O().block_worth(torch.zeros(2, 3, 4))
