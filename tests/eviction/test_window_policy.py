from __future__ import annotations

import pytest
import torch

from eviction import POLICIES, Policy, ScoreContext, SeqWindow, Window
from eviction.select import cdiv
from eviction.sketch import sketch_keys


def _context(num_tokens: int = 1000, block_tokens: int = 16, num_kv_heads: int = 2, seed: int = 0) -> ScoreContext:
    g = torch.Generator().manual_seed(seed)
    num_blocks = cdiv(num_tokens, block_tokens)
    summaries, sketch = sketch_keys(torch.randn(num_tokens, num_kv_heads, 32, generator=g).half(), block_tokens)
    return ScoreContext(
        summaries=summaries,
        sketch=sketch,
        window=SeqWindow(num_tokens=num_tokens, block_tokens=block_tokens, sink_tokens=40, recent_tokens=100),
        q=torch.randn(num_kv_heads * 3, 32, generator=g).half(),
        h2o_scores=torch.rand(num_kv_heads, num_blocks, generator=g),
    )


def test_window_keeps_only_sinks_and_recent() -> None:
    ctx = _context()
    chosen = Window().select(ctx, budget_tokens=0)
    protected = SeqWindow(num_tokens=1000, block_tokens=16, sink_tokens=40, recent_tokens=100).protected_mask()
    assert chosen.tolist() == [protected.nonzero().flatten().tolist()] * 2
    assert chosen[0].tolist() == [0, 1, 2, *range(56, 63)]  # tokens 900..999 start in block 56


def test_window_budget_widens_the_recent_window() -> None:
    chosen = Window().select(_context(), budget_tokens=20 * 16)
    assert chosen[0].tolist() == [0, 1, 2] + list(range(46, 63))
    assert torch.equal(chosen[0], chosen[1])


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("num_tokens,block_tokens,budget", [(1000, 16, 256), (77, 8, 0), (300, 32, 300 * 2)])
def test_every_policy_returns_sorted_tables_with_protected_blocks(name, num_tokens, block_tokens, budget) -> None:
    policy = POLICIES[name]()
    assert isinstance(policy, Policy)
    ctx = _context(num_tokens, block_tokens, seed=num_tokens)
    chosen = policy.select(ctx, budget_tokens=budget)
    num_blocks = ctx.num_blocks
    window = SeqWindow(num_tokens=num_tokens, block_tokens=block_tokens, sink_tokens=40, recent_tokens=100)
    protected = set(window.protected_mask().nonzero().flatten().tolist())
    k = min(num_blocks, max(len(protected), budget // block_tokens))
    assert chosen.dtype == torch.int64 and chosen.shape == (ctx.num_kv_heads, k)
    for row in chosen.tolist():
        assert row == sorted(set(row)) and row[-1] == num_blocks - 1 and protected <= set(row)


def test_base_policy_has_no_score() -> None:
    with pytest.raises(TypeError, match="abstract"):
        Policy()
