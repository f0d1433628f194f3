from __future__ import annotations

import pytest
import torch

from eviction import POLICIES, ScoreContext, SeqWindow, TopK, topk_select
from eviction.select import cdiv, select
from eviction.quest_kernel import quest_scores_ref
from eviction.summaries import summarize_keys


def _needle_case(num_kv_heads: int, group: int, head_dim: int, seed: int):
    """Random keys with one key per kv head aligned with one of its q heads, far from sinks and recent."""
    g = torch.Generator().manual_seed(seed)
    num_tokens, block_tokens = 3001, 16
    keys = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)  # [T, H, D]
    q = torch.randn(num_kv_heads * group, head_dim, generator=g)  # [H*G, D]
    needles = torch.randint(200, 2500, (num_kv_heads,), generator=g)  # one token per kv head
    for head, token in enumerate(needles.tolist()):
        q_head = q[head * group + token % group]
        keys[token, head] = 4.0 * q_head / q_head.norm() * head_dim**0.5  # ~4x a typical key's norm
    window = SeqWindow(num_tokens=num_tokens, block_tokens=block_tokens, sink_tokens=32, recent_tokens=256)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel path needs device tensors on a GPU box
    return q.half().to(device), summarize_keys(keys.half(), block_tokens).to(device), needles // block_tokens, window


@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(2, 1, 64), (2, 3, 128), (1, 4, 128), (2, 8, 64)])
@pytest.mark.parametrize("use_kernel", [False, True])
def test_planted_needle_is_selected_with_a_small_budget(num_kv_heads, group, head_dim, use_kernel) -> None:
    q, summaries, needle_blocks, window = _needle_case(num_kv_heads, group, head_dim, seed=group * head_dim)
    budget = 256 + 32 + 4 * 16  # the protected blocks plus 4 more: 4 of ~170 candidate blocks
    chosen = topk_select(q, summaries, window, budget_tokens=budget, use_kernel=use_kernel)
    assert chosen.shape == (num_kv_heads, (budget // 16))
    for head, block in enumerate(needle_blocks.tolist()):
        assert block in chosen[head].tolist(), f"kv head {head}: needle block {block} not in {chosen[head].tolist()}"


def test_kernel_and_reference_paths_select_the_same_blocks() -> None:
    q, summaries, _, window = _needle_case(2, 4, 64, seed=11)
    for budget in (0, 500, 1200):
        ref = topk_select(q, summaries, window, budget_tokens=budget, use_kernel=False)
        fused = topk_select(q, summaries, window, budget_tokens=budget, use_kernel=True)
        assert torch.equal(ref, fused)


def test_policy_select_matches_shared_select_and_covers_all() -> None:
    q, summaries, _, window = _needle_case(2, 3, 64, seed=7)
    ctx = ScoreContext(summaries, window, q=q)
    policy = POLICIES["topk"]()
    assert isinstance(policy, TopK)
    chosen = policy.select(ctx, budget_tokens=1000)
    assert torch.equal(chosen, select(quest_scores_ref(q, summaries), window, budget_tokens=1000))
    assert bool((chosen[:, -1] == ctx.num_blocks - 1).all())
    protected = window.protected_mask().nonzero().flatten().tolist()
    assert all(set(protected) <= set(row) for row in chosen.tolist())
    everything = policy.select(ctx, budget_tokens=cdiv(3001, 16) * 16)
    assert everything.tolist() == [list(range(cdiv(3001, 16)))] * 2


def test_topk_rejects_missing_query_and_mismatched_summaries() -> None:
    q, summaries, _, window = _needle_case(2, 1, 64, seed=1)
    with pytest.raises(ValueError, match="ctx.q"):
        TopK().select(ScoreContext(summaries, window), budget_tokens=512)
    with pytest.raises(ValueError, match="expected 188 blocks"):
        topk_select(q, summaries[:-1], window, budget_tokens=512)
    with pytest.raises(ValueError, match="group_reduce"):
        TopK(group_reduce="mean")
    with pytest.raises(ValueError, match="summaries"):
        ScoreContext(summaries[:-1], window)
