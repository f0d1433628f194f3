"""The full 4-bit sketch kernel (the fine pass and the full scan) against its torch reference (under
TRITON_INTERPRET=1 without a GPU), its upper bound against the true keys, and refine_candidates' merge."""

from __future__ import annotations

import pytest
import torch

from bench_longctx.sketch_bench import true_block_lse  # the exact per-block log-sum-exp the bound must cover
from eviction.sketch import sketch_keys
from eviction.sketch_kernel import refine_candidates, sketch_block_stats, sketch_block_stats_ref
from eviction.sketch_topk import refine_candidates_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(num_tokens: int, block_tokens: int, num_kv_heads: int, group: int, head_dim: int,
              seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [Hq, D], summaries, codes, keys [T, H, D]) on DEVICE: keys with an outlier channel and a shared mean
    direction (irregular, never zeros); the sketch tests' common case."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g) * 1.5
    keys[..., 1] *= 10.0  # one outlier channel
    keys = (keys + 2.0 * torch.randn(head_dim, generator=g)).half()  # a shared mean direction
    q = (torch.randn(num_kv_heads * group, head_dim, generator=g) * 2).half()
    summaries, codes = sketch_keys(keys, block_tokens)
    return q.to(DEVICE), summaries.to(DEVICE), codes.to(DEVICE), keys.to(DEVICE)


@pytest.mark.parametrize("num_tokens,block_tokens,num_kv_heads,group,head_dim", [
    (37, 16, 2, 3, 64),  # partial tail, odd group
    (96, 32, 1, 4, 128),  # full blocks, llama3 head size, one kv head
    (50, 24, 2, 1, 32),  # even block size that is not a power of two, no GQA
    (9, 64, 3, 2, 64),  # one partial block
    (5 * 64 - 3, 64, 2, 4, 128),  # llama3-8b's group and blocks
])
def test_kernel_matches_reference(num_tokens, block_tokens, num_kv_heads, group, head_dim) -> None:
    q, summaries, codes, keys = make_case(num_tokens, block_tokens, num_kv_heads, group, head_dim, seed=num_tokens)
    want = sketch_block_stats_ref(q, summaries, codes, num_tokens)
    got = sketch_block_stats(q, summaries, codes, num_tokens)
    num_blocks = summaries.shape[0]
    for w, g in zip(want, got):
        assert g.shape == (num_kv_heads * group, num_blocks) and g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)
    true = true_block_lse(q, keys, block_tokens)
    assert (got[1] >= true).all() and (want[1] >= true).all()


@pytest.mark.parametrize("group", [4, 1])  # 1: no GQA, the shape triton 3.6 miscompiled in sketch_channels.py
@pytest.mark.parametrize("blocks_per_program,decode,warps", [(1, 0, 2), (3, 1, 1), (8, 0, 4)])
def test_tuning_knobs_do_not_change_results(blocks_per_program, decode, warps, group) -> None:
    """Every knob setting the benchmark sweeps computes the same thing (here 7 blocks: programs run past the end)."""
    q, summaries, codes, keys = make_case(7 * 64 - 10, 64, 2, group, 128, seed=11)
    want = sketch_block_stats_ref(q, summaries, codes, keys.shape[0])
    ids = torch.tensor([[6, 0, 3, 1, 5], [2, 6, 4, 0, 1]], device=DEVICE)  # candidate mode, unsorted, tail included
    want_ids = sketch_block_stats_ref(q, summaries, codes, keys.shape[0], block_ids=ids)
    knobs = dict(blocks_per_program=blocks_per_program, decode=decode, num_warps=warps)
    got = sketch_block_stats(q, summaries, codes, keys.shape[0], **knobs)
    got_ids = sketch_block_stats(q, summaries, codes, keys.shape[0], block_ids=ids, **knobs)
    for w, g in zip(want + want_ids, got + got_ids):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(want_ids[0], want[0].gather(1, ids.repeat_interleave(group, dim=0)))


def test_refine_scores_candidates_and_merges_their_bounds() -> None:
    """The captured selection's fine pass: capacity rows past the live ones hold garbage, a hole in `valid`, a
    kept block; scores and the in-place min into the first level's bound match the reference."""
    q, summaries, codes, keys = make_case(12 * 32, 32, 2, 3, 64, seed=9)
    capacity = torch.cat((summaries, torch.full((4, *summaries.shape[1:]), float("nan"), device=DEVICE).half()))
    codes = torch.cat((codes, torch.randint(0, 256, (4, *codes.shape[1:]), dtype=torch.uint8, device=DEVICE)))
    valid = torch.arange(16, device=DEVICE) < 12
    valid[7] = False  # a hole: block 6 ranks as a tail
    keep = torch.zeros(16, dtype=torch.bool, device=DEVICE)
    keep[[0, 11]] = True
    g = torch.Generator().manual_seed(1)
    z = torch.randn(6, generator=g).to(DEVICE) + 3.0
    candidates = torch.stack([torch.randperm(16, generator=g)[:9].sort().values for _ in range(2)]).to(DEVICE)
    first_upper = torch.randn(6, 16, generator=g).to(DEVICE) + 6.0
    got_upper, want_upper = first_upper.clone(), first_upper.clone()
    got = refine_candidates(q, capacity, codes, candidates, z, keep, valid, got_upper, blocks_per_program=2)
    want = refine_candidates_ref(q, capacity, codes, candidates, z, keep, valid, want_upper, 16 * 32)
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got == 0, want == 0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)  # GPU dots sum in another order (H200: 1.1e-5)
    torch.testing.assert_close(got_upper, want_upper, rtol=1e-5, atol=1e-4)
    assert torch.equal(got_upper[:, ~valid], first_upper[:, ~valid])  # dead blocks' bounds are left alone
    fine = sketch_block_stats_ref(q, summaries, codes[:12], 12 * 32)[1]
    live = valid[:12]
    assert bool((got_upper[:, :12][:, live] <= first_upper[:, :12][:, live]).all())
    assert bool((got_upper[:, :12] >= torch.minimum(fine, first_upper[:, :12]) - 1e-4).all())


def test_upper_bound_holds_for_keys_on_rounding_edges() -> None:
    """Adversarial: every key sits half a step off its grid point, on the side q favours, in every channel."""
    g = torch.Generator().manual_seed(7)
    block_tokens, head_dim = 16, 64
    q = torch.randn(2, head_dim, generator=g).half()
    low, high = -torch.rand(head_dim, generator=g) - 0.5, torch.rand(head_dim, generator=g) + 0.5
    step = (high - low) / 15
    grid = torch.randint(1, 15, (3 * block_tokens, head_dim), generator=g).float()
    keys = low + step * (grid + 0.49 * torch.sign(q[0].float()))
    keys[0], keys[1] = low, high  # pin each block's min and max
    keys[16], keys[17], keys[32], keys[33] = low, high, low, high
    keys = keys.half()[:, None]  # [T, 1, D]
    summaries, codes = sketch_keys(keys, block_tokens)
    true = true_block_lse(q.to(DEVICE), keys.to(DEVICE), block_tokens)
    lse, upper = sketch_block_stats(q.to(DEVICE), summaries.to(DEVICE), codes.to(DEVICE), 48)
    assert (upper >= true).all()
    assert (lse[0] < true[0] - 0.2).all()  # q head 0's estimate is fooled, its bound is not


@pytest.mark.parametrize("seed", range(4))
def test_upper_bound_holds_on_random_keys_with_outliers(seed) -> None:
    """Outlier channels (x50), outlier tokens (x20) and a large q: the fp16 rounding of q * step is largest
    next to big steps, and the bound must still cover every block's true log-sum-exp."""
    g = torch.Generator().manual_seed(seed)
    num_tokens, block_tokens, num_kv_heads, group, head_dim = 5 * 64 - 17, 64, 2, 4, 128
    keys = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    keys[..., torch.randint(0, head_dim, (3,), generator=g)] *= 50.0
    keys[torch.randint(0, num_tokens, (9,), generator=g)] *= 20.0
    keys = keys.half()
    q = (torch.randn(num_kv_heads * group, head_dim, generator=g) * 8).half()
    summaries, codes = sketch_keys(keys, block_tokens)
    q, summaries, codes, keys = q.to(DEVICE), summaries.to(DEVICE), codes.to(DEVICE), keys.to(DEVICE)
    true = true_block_lse(q, keys, block_tokens)
    lse, upper = sketch_block_stats(q, summaries, codes, num_tokens)
    assert (upper >= true).all(), (upper - true).min()
    want = sketch_block_stats_ref(q, summaries, codes, num_tokens)
    torch.testing.assert_close(upper, want[1], rtol=1e-5, atol=1e-3)


def test_fp16_overflow_falls_back_to_the_min_max_bound() -> None:
    """|q step| past fp16's range: the estimate is not trusted, upper is Quest's bound, still above the truth."""
    q, summaries, codes, keys = make_case(40, 16, 1, 2, 64, seed=3)
    keys = keys * 400.0  # steps ~ 100
    summaries, codes = sketch_keys(keys.cpu(), 16)
    summaries, codes = summaries.to(DEVICE), codes.to(DEVICE)
    q = (q.float() * 400).half()  # |q step| > 65504 somewhere in every block
    true = true_block_lse(q, keys, 16)
    lse, upper = sketch_block_stats(q, summaries, codes, 40)
    want = sketch_block_stats_ref(q, summaries, codes, 40)
    assert torch.isfinite(upper).all() and (upper >= true).all()
    torch.testing.assert_close(upper, want[1], rtol=1e-5, atol=1e-2)


def test_bad_input_raises() -> None:
    q, summaries, codes, _ = make_case(40, 16, 2, 2, 64, seed=1)
    with pytest.raises(ValueError, match="num_tokens"):
        sketch_block_stats(q, summaries, codes, 49)
    with pytest.raises(ValueError, match="q: expected float16"):
        sketch_block_stats(q.float(), summaries, codes, 40)
    with pytest.raises(ValueError, match="codes"):
        sketch_block_stats(q, summaries, codes[:, :1], 40)
    with pytest.raises(ValueError, match="knobs"):
        sketch_block_stats(q, summaries, codes, 40, blocks=4)
    with pytest.raises(ValueError, match="block_ids"):
        sketch_block_stats(q, summaries, codes, 40, block_ids=torch.zeros(3, 2, dtype=torch.int64, device=DEVICE))
    odd_summaries, odd_codes = sketch_keys(torch.randn(9, 2, 64).half(), 3)
    with pytest.raises(ValueError, match="even block size"):
        sketch_block_stats(q.cpu(), odd_summaries, odd_codes, 9)
    assert sketch_block_stats_ref(q.cpu(), odd_summaries, odd_codes, 9)[0].shape == (4, 3)  # the reference: any size
