"""H2O drop mode through the decode step (kvstore/decode/step_h2o.py), token by token against the DecodePath
(eager.py) it replaced: the same blocks drop at the same tokens, and the outputs are the same (bit for bit on
CPU), from store.attend, at budgets the budget or the protected blocks set, over cpu-tier blocks and on a
fork. Batches of h2o sequences: tests/kvstore/decode/test_batch.py; a serving trace: test_serving.py."""

from __future__ import annotations

import pytest
import torch

from eviction import H2O
from tests.kvstore.decode.test_eager_step import api_token, old_path_token
from tests.kvstore.decode.test_step import DEVICE, SPEC, cold_pair, tokens, twin_stores

L = SPEC.num_layers


def like_the_old_path(got: torch.Tensor, want: torch.Tensor) -> None:
    """The step against the DecodePath: bit for bit on CPU, where both run the kernel's reference; within fp16
    rounding on CUDA, where the step appends inside its attention launch and the split plans differ."""
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def h2o_alongside(api, old, sa, sb, num_tokens: int, budget: int, seed: int, mode=None) -> list[int]:
    """num_tokens h2o tokens through the public API (api) and through the DecodePath (old): outputs and the
    dropped blocks of every layer compared at each token; returns layer 0's dropped count after each."""
    work, drops = tokens(num_tokens, seed=seed), []
    for t in range(num_tokens):
        token = work[t * L: (t + 1) * L]
        for got, want in zip(api_token(api, sa, token, mode=mode or "h2o", budget=budget),
                             old_path_token(old, sb, token, mode=mode or "h2o", budget=budget)):
            like_the_old_path(got, want)
        for layer in range(L):
            assert api.table(sa, layer).block_ids.count(-1) == old.table(sb, layer).block_ids.count(-1), (t, layer)
        drops.append(old.table(sb, 0).num_dropped)
    return drops


@pytest.mark.parametrize("mode, budget", [("h2o", 64), ("h2o", 128), ("h2o", 16), (H2O(head_reduce="sum"), 64)],
                         ids=["h2o-64", "h2o-128", "h2o-16", "instance-sum"])
def test_h2o_runs_through_the_step_and_drops_what_the_eager_path_drops(tmp_path, mode, budget):
    """H2O drop mode through store.attend: its first token seeds the all-zero scores of the prefill through the
    DecodePath (counted not_ready), every later one runs through the step, which drops the same blocks at the
    same tokens as the DecodePath (the old path, in the twin store) and gives its outputs (like_the_old_path); from
    150 tokens, 130 tokens: 8 block boundaries, each dropping a block in every layer, hot -> warm cooling. At a
    budget of 16 tokens the protected blocks set keep, and a block also drops the token after a boundary, when
    the 2-token recent window leaves it."""
    api, old, sa, sb = twin_stores(tmp_path, 150, seed=2)
    drops = h2o_alongside(api, old, sa, sb, 130, budget, seed=3, mode=mode)
    stats = api.stats()["attend"]
    assert stats["step_calls"] == 129 * L and stats["fallback_calls"] == {"not_ready": L}
    assert drops[-1] >= 8 and len(set(drops)) > 8  # blocks dropped at many tokens, not once
    for layer in range(L):
        ta, tb = api.table(sa, layer), old.table(sb, layer)
        assert [b == -1 for b in ta.block_ids] == [b == -1 for b in tb.block_ids]
        n = ta.num_blocks
        assert torch.equal(ta.summaries[:n], tb.summaries[:n])
        like_the_old_path(ta.h2o_scores[:, :n], tb.h2o_scores[:, :n])
        for x, y in zip(api.read(sa, layer, ta.num_tokens - 8), old.read(sb, layer, tb.num_tokens - 8)):
            assert torch.equal(x, y)  # the recent window: never dropped
    for key in ("calls", "context_tokens", "attended_tokens"):
        assert stats[key] == old.stats()["attend"][key], key
    api.check_integrity(), old.check_integrity()
    api.close(), old.close()


def test_h2o_through_the_step_stages_its_live_cpu_blocks(tmp_path):
    """H2O drop mode over a 600-token prefill mostly in an int8 cpu tier (no promotion, so its live blocks stay
    there): the step stages their head slices and gives the DecodePath's outputs and drops."""
    api, old, (sa, sb) = cold_pair(tmp_path, "h2o", promotions_per_boundary=0)
    h2o_alongside(api, old, sa, sb, 40, 128, seed=7)
    stats = api.stats()["attend"]
    assert stats["step_calls"] == 39 * L and stats["cold_slices_staged"] > 0
    assert api.table(sa, 0).num_cold > 0
    for layer in range(L):
        ta, tb = api.table(sa, layer), old.table(sb, layer)
        assert [b == -1 for b in ta.block_ids] == [b == -1 for b in tb.block_ids]
    api.check_integrity(), old.check_integrity()
    api.close(), old.close()


def test_h2o_through_the_step_on_a_fork_leaves_the_parent_whole(tmp_path):
    """A fork decodes in h2o mode through the step and drops blocks it shares with its parent: the parent keeps
    every token, and the fork's outputs and drops equal the DecodePath's on a twin fork."""
    api, old, pa, pb = twin_stores(tmp_path, 150, seed=4)
    before = [api.read(pa, layer) for layer in range(L)]
    sa, sb = api.fork(pa), old.fork(pb)
    h2o_alongside(api, old, sa, sb, 60, 64, seed=5)
    assert api.stats()["attend"]["step_calls"] == 59 * L
    for layer in range(L):
        assert api.table(sa, layer).num_dropped == old.table(sb, layer).num_dropped > 0
        for x, y in zip(api.read(pa, layer), before[layer]):
            assert torch.equal(x, y)
    api.check_integrity(), old.check_integrity()
    api.close(), old.close()
