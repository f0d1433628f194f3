"""The previous first level (eviction/sketch_planes.py, kept for the benchmark's comparison) against its torch
reference (under TRITON_INTERPRET=1 without a GPU), its upper bound against the true keys, and its selection."""

from __future__ import annotations

import pytest
import torch

from bench_longctx.sketch_bench import true_block_lse  # the exact per-block log-sum-exp the bound must cover
from eviction.sketch import sketch_keys as sketch_channel_major, unpack
from eviction.sketch_planes import pack_planes, plane_block_stats as sketch_block_stats
from eviction.sketch_planes import plane_block_stats_ref as sketch_block_stats_ref
from eviction.sketch_planes import select_masked_planes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sketch_keys(keys: torch.Tensor, block_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(summaries, codes in the old two-plane layout)."""
    summaries, codes = sketch_channel_major(keys, block_tokens)
    return summaries, pack_planes(unpack(codes).to(torch.int64))


def _case(num_tokens, block_tokens, num_kv_heads, group, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g) * 1.5
    keys[..., 1] *= 10.0  # one outlier channel
    keys = (keys + 2.0 * torch.randn(head_dim, generator=g)).half()  # a shared mean direction
    q = (torch.randn(num_kv_heads * group, head_dim, generator=g) * 2).half()
    summaries, codes = sketch_keys(keys, block_tokens)
    return q.to(DEVICE), summaries.to(DEVICE), codes.to(DEVICE), keys.to(DEVICE)


@pytest.mark.parametrize("num_tokens,block_tokens,num_kv_heads,group,head_dim", [
    (37, 16, 2, 3, 64),  # partial tail, odd group
    (96, 32, 1, 4, 128),  # full blocks, llama3 head size
    (50, 24, 2, 1, 32),  # block size not a power of two, no GQA, a quarter narrower than tl.dot's K
    (9, 64, 3, 2, 64),  # one partial block
    (5 * 64 - 3, 64, 2, 4, 128),  # llama3-8b's group and blocks, 5 blocks (not a multiple of blocks_per_program)
])
@pytest.mark.parametrize("planes", [1, 2])
def test_kernel_matches_reference(num_tokens, block_tokens, num_kv_heads, group, head_dim, planes) -> None:
    q, summaries, codes, keys = _case(num_tokens, block_tokens, num_kv_heads, group, head_dim, seed=num_tokens)
    want = sketch_block_stats_ref(q, summaries, codes, num_tokens, planes=planes)
    got = sketch_block_stats(q, summaries, codes, num_tokens, planes=planes)
    num_blocks = summaries.shape[0]
    for w, g in zip(want, got):
        assert g.shape == (num_kv_heads * group, num_blocks) and g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)
    true = true_block_lse(q, keys, block_tokens)
    assert (got[1] >= true).all() and (want[1] >= true).all()


@pytest.mark.parametrize("blocks_per_program,decode", [(1, 0), (3, 1), (8, 0)])
@pytest.mark.parametrize("planes", [1, 2])
def test_tuning_knobs_do_not_change_results(blocks_per_program, decode, planes) -> None:
    """Every knob setting the benchmark sweeps computes the same thing (here 7 blocks: programs run past the end)."""
    q, summaries, codes, keys = _case(7 * 64 - 10, 64, 2, 4, 128, seed=11)
    want = sketch_block_stats_ref(q, summaries, codes, keys.shape[0], planes=planes)
    ids = torch.tensor([[6, 0, 3, 1, 5], [2, 6, 4, 0, 1]], device=DEVICE)  # candidate mode, unsorted, tail included
    want_ids = sketch_block_stats_ref(q, summaries, codes, keys.shape[0], planes=planes, block_ids=ids)
    knobs = dict(blocks_per_program=blocks_per_program, decode=decode)
    got = sketch_block_stats(q, summaries, codes, keys.shape[0], planes=planes, **knobs)
    got_ids = sketch_block_stats(q, summaries, codes, keys.shape[0], planes=planes, block_ids=ids, **knobs)
    for w, g in zip(want + want_ids, got + got_ids):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)


def test_candidate_columns_and_strided_capacity() -> None:
    q, summaries, codes, keys = _case(150, 16, 2, 2, 64, seed=5)
    num_blocks = summaries.shape[0]
    capacity = torch.randint(0, 255, (num_blocks + 7, *codes.shape[1:]), dtype=torch.uint8, device=DEVICE)
    capacity[:num_blocks] = codes  # the store's buffer: only a prefix is live
    ids = torch.tensor([[9, 0, 3], [2, 9, 7]], device=DEVICE)  # [H, C], unsorted, the tail block included
    full = sketch_block_stats_ref(q, summaries, codes, 150)
    for planes in (1, 2):
        got = sketch_block_stats(q, summaries, capacity, 150, planes=planes, block_ids=ids)
        want = sketch_block_stats_ref(q, summaries, capacity, 150, planes=planes, block_ids=ids)
        for w, g in zip(want, got):
            assert g.shape == (4, 3)
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)
    rows = ids.repeat_interleave(2, dim=0)
    torch.testing.assert_close(want[0], full[0].gather(1, rows))


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
    for planes in (1, 2):
        lse, upper = sketch_block_stats(q.to(DEVICE), summaries.to(DEVICE), codes.to(DEVICE), 48, planes=planes)
        assert (upper >= true).all()
    assert (lse[0] < true[0] - 0.2).all()  # both planes: q head 0's estimate is fooled, its bound is not


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
    for planes in (1, 2):
        lse, upper = sketch_block_stats(q, summaries, codes, num_tokens, planes=planes)
        assert (upper >= true).all(), (upper - true).min()
        want = sketch_block_stats_ref(q, summaries, codes, num_tokens, planes=planes)
        torch.testing.assert_close(upper, want[1], rtol=1e-5, atol=1e-3)


def test_fp16_overflow_falls_back_to_the_min_max_bound() -> None:
    """|4 q step| past fp16's range: the estimate is not trusted, upper is Quest's bound, still above the truth."""
    q, summaries, codes, keys = _case(40, 16, 1, 2, 64, seed=3)
    keys = keys * 400.0  # steps ~ 100
    summaries, codes = sketch_keys(keys.cpu(), 16)
    summaries, codes = summaries.to(DEVICE), codes.to(DEVICE)
    q = (q.float() * 100).half()  # |q step| > 65504 somewhere in every block
    true = true_block_lse(q, keys, 16)
    for planes in (1, 2):
        lse, upper = sketch_block_stats(q, summaries, codes, 40, planes=planes)
        want = sketch_block_stats_ref(q, summaries, codes, 40, planes=planes)
        assert torch.isfinite(upper).all() and (upper >= true).all()
        torch.testing.assert_close(upper, want[1], rtol=1e-5, atol=1e-2)


def test_bad_input_raises() -> None:
    q, summaries, codes, _ = _case(40, 16, 2, 2, 64, seed=1)
    with pytest.raises(ValueError, match="num_tokens"):
        sketch_block_stats(q, summaries, codes, 49)
    with pytest.raises(ValueError, match="q: expected float16"):
        sketch_block_stats(q.float(), summaries, codes, 40)
    with pytest.raises(ValueError, match="codes"):
        sketch_block_stats(q, summaries, codes[:, :1], 40)
    with pytest.raises(ValueError, match="planes"):
        sketch_block_stats_ref(q, summaries, codes, 40, planes=3)
    with pytest.raises(ValueError, match="knobs"):
        sketch_block_stats(q, summaries, codes, 40, blocks=4)
    with pytest.raises(ValueError, match="block_ids"):
        sketch_block_stats(q, summaries, codes, 40, block_ids=torch.zeros(3, 2, dtype=torch.int64, device=DEVICE))


def test_old_selection_keeps_the_protected_blocks() -> None:
    q, summaries, codes, _ = _case(40 * 16, 16, 2, 2, 64, seed=4)
    valid = torch.ones(40, dtype=torch.bool, device=DEVICE)
    protected = torch.zeros(40, dtype=torch.bool, device=DEVICE)
    protected[[0, 38, 39]] = True
    for coarse_factor in (0, 2):
        selected, upper = select_masked_planes(q, summaries, codes, valid, protected, 8, coarse_factor)
        assert selected.shape == (2, 8) and upper.shape == (4, 40)
        for row in selected.tolist():
            assert row == sorted(row) and {0, 38, 39} <= set(row)
