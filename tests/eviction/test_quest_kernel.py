"""The fused Quest kernel against its torch reference (under TRITON_INTERPRET=1 without a GPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eviction.quest_kernel import quest_scores, quest_scores_ref
from eviction.summaries import summaries_to_fp8, summarize_keys

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(num_blocks, num_kv_heads, group, head_dim, block_tokens=4, seed=0, scale=1.0):
    """Random q and the summaries of random keys: [H*G, D], [N, 2, H, D]."""
    g = torch.Generator().manual_seed(seed)
    num_tokens = num_blocks * block_tokens - (seed % block_tokens)  # a partial tail block
    keys = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=g) * scale).half()
    q = torch.randn(num_kv_heads * group, head_dim, generator=g).half()
    return q.to(DEVICE), summarize_keys(keys, block_tokens).to(DEVICE), keys.to(DEVICE)


def _literal(q: torch.Tensor, summaries: torch.Tensor, group_reduce: str) -> torch.Tensor:
    """Quest's formula as written: sum_d max(q_d * max_d, q_d * min_d), per q head, then over the group."""
    num_blocks, _, num_kv_heads, head_dim = summaries.shape
    s = summaries.float()
    qg = q.float().view(num_kv_heads, -1, 1, head_dim)  # [H, G, 1, D]
    k_min, k_max = s[:, 0].transpose(0, 1)[:, None], s[:, 1].transpose(0, 1)[:, None]  # [H, 1, N, D]
    bound = torch.maximum(qg * k_max, qg * k_min).sum(-1)  # [H, G, N]
    return bound.amax(1) if group_reduce == "max" else bound.sum(1)


@pytest.mark.parametrize(
    "num_blocks,num_kv_heads,group,head_dim",
    [(1, 2, 1, 64), (37, 2, 3, 128), (129, 1, 4, 128), (70, 2, 8, 64), (17, 3, 4, 64), (65, 1, 1, 128)],
)
@pytest.mark.parametrize("group_reduce", ["max", "sum"])
@pytest.mark.parametrize("use_dot", [True, False])
def test_kernel_matches_reference(num_blocks, num_kv_heads, group, head_dim, group_reduce, use_dot) -> None:
    q, summaries, _ = _inputs(num_blocks, num_kv_heads, group, head_dim, seed=num_blocks + group)
    expected = quest_scores_ref(q, summaries, group_reduce=group_reduce)
    got = quest_scores(q, summaries, group_reduce=group_reduce, use_dot=use_dot, block_n=32)
    assert got.dtype == torch.float32 and got.shape == (num_kv_heads, num_blocks)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(expected, _literal(q, summaries, group_reduce), rtol=1e-5, atol=1e-3)


def test_kernel_reads_fp8_and_strided_summaries() -> None:
    q, summaries, _ = _inputs(45, 2, 4, 64, seed=3)
    capacity = torch.randn(60, 2, 2, 64, device=DEVICE).half()  # the store's buffer; only a prefix is live
    capacity[:45] = summaries
    view = capacity[:45]
    torch.testing.assert_close(quest_scores(q, view), quest_scores_ref(q, summaries), rtol=1e-5, atol=1e-3)
    fp8 = summaries_to_fp8(summaries)
    for use_dot in (True, False):
        got = quest_scores(q, fp8, use_dot=use_dot)
        torch.testing.assert_close(got, quest_scores_ref(q, fp8), rtol=1e-5, atol=1e-3)


def test_kernel_protects_sinks_and_recent() -> None:
    q, summaries, _ = _inputs(50, 2, 3, 64, seed=5)
    got = quest_scores(q, summaries, sink_blocks=3, recent_start=44, block_n=16)
    expected = quest_scores_ref(q, summaries)
    assert bool(torch.isinf(got[:, :3]).all() and torch.isinf(got[:, 44:]).all() and (got[:, :3] > 0).all())
    torch.testing.assert_close(got[:, 3:44], expected[:, 3:44], rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize(
    "q,summaries,kwargs,message",
    [
        (torch.randn(4, 64), torch.randn(3, 2, 2, 64).half(), {}, "q: expected float16"),
        (torch.randn(4, 64).half(), torch.randn(3, 2, 2, 64), {}, "summaries: expected"),
        (torch.randn(4, 32).half(), torch.randn(3, 2, 2, 64).half(), {}, "q: expected"),
        (torch.randn(3, 64).half(), torch.randn(3, 2, 2, 64).half(), {}, "multiple of kv_heads"),
        (torch.randn(4, 64).half(), torch.randn(3, 3, 2, 64).half(), {}, "summaries: expected"),
        (torch.randn(4, 64).half(), torch.randn(3, 2, 2, 64).half(), dict(group_reduce="mean"), "group_reduce"),
        (torch.randn(4, 64).half(), torch.randn(3, 2, 2, 64).half(), dict(block_n=48), "block_n"),
    ],
)
def test_launcher_rejects_bad_input(q, summaries, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        quest_scores(q, summaries, **kwargs)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    num_tokens=st.integers(1, 90),
    block_tokens=st.sampled_from([1, 4, 16]),
    num_kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([16, 64]),
    scale=st.sampled_from([1e-3, 1.0, 40.0]),
)
def test_bound_is_an_upper_bound_of_every_key(
    seed, num_tokens, block_tokens, num_kv_heads, group, head_dim, scale
) -> None:
    g = torch.Generator().manual_seed(seed)
    keys = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=g) * scale).half()  # [T, H, D]
    q = torch.randn(num_kv_heads * group, head_dim, generator=g).half()  # [H*G, D]
    summaries = summarize_keys(keys, block_tokens)
    logits = torch.einsum("hgd,thd->hgt", q.float().view(num_kv_heads, group, -1), keys.float())  # [H, G, T]
    slack = 1e-5 * torch.einsum("hgd,thd->hgt", q.float().abs().view(num_kv_heads, group, -1), keys.float().abs())
    token_block = torch.arange(num_tokens) // block_tokens  # [T]
    fp8 = summaries_to_fp8(summaries)
    assert bool((fp8[:, 0].float() <= summaries[:, 0].float()).all()), "fp8 minima must round down"
    assert bool((fp8[:, 1].float() >= summaries[:, 1].float()).all()), "fp8 maxima must round up"
    for bound in (
        quest_scores_ref(q, summaries),
        quest_scores(q.to(DEVICE), summaries.to(DEVICE), block_n=16).cpu(),
        quest_scores_ref(q, fp8),
    ):
        per_token = bound[:, None, token_block]  # [H, 1, T]: the bound of each token's block
        assert bool((logits <= per_token + slack + 1e-6).all())


@pytest.mark.parametrize("count, block_tokens, sink_blocks, recent_tokens", [
    (0, 16, 1, 32), (37, 16, 1, 32), (63, 16, 2, 100), (64, 16, 0, 0), (149, 32, 1, 1000), (15, 16, 1, 16),
])
def test_live_scores_mask_from_the_device_count(count, block_tokens, sink_blocks, recent_tokens):
    """A preallocated table: blocks past the device count score -inf, sinks and the recent window +inf,
    garbage in unwritten capacity never leaks."""
    from eviction.quest_kernel import quest_scores_live, quest_scores_live_ref

    q, summaries, _ = _inputs(12, 2, 4, 64, block_tokens=16, seed=count)
    capacity = torch.full((12, 2, 2, 64), float("nan"), dtype=torch.float16, device=DEVICE)
    live = -(-(count + 1) // block_tokens)
    capacity[:live] = summaries[:live]
    capacity[live:, 0] = float("inf")  # a fresh tail's empty box, or whatever the pool held
    n = torch.tensor([count], dtype=torch.int64, device=DEVICE)
    kw = dict(block_tokens=block_tokens, sink_blocks=sink_blocks, recent_tokens=recent_tokens)
    got, want = quest_scores_live(q, capacity, n, **kw), quest_scores_live_ref(q, capacity, n, **kw)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(got > 0, want > 0)
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=1e-3, atol=1e-2)
    start = min(max(count + 1 - recent_tokens, 0) // block_tokens, live - 1)
    assert (want[:, live:] == float("-inf")).all()
    protected = [i for i in range(live) if i < sink_blocks or i >= start]
    assert (want[:, protected] == float("inf")).all()
    assert torch.isfinite(want[:, [i for i in range(live) if i not in protected]]).all()
    with pytest.raises(ValueError, match="count"):
        quest_scores_live(q, capacity, n.int(), **kw)
