"""The sketch selector's first level (a few channels' codes, the rest bounded by min/max): kernel against its torch
reference on irregular shapes (under TRITON_INTERPRET=1 without a GPU), and its upper bound against the true keys
on adversarial blocks."""

from __future__ import annotations

import pytest
import torch

from bench_longctx.sketch_bench import true_block_lse  # the exact per-block log-sum-exp the bound must cover
from eviction.sketch import sketch_keys
from eviction.sketch_channels import channel_block_stats, channel_block_stats_ref
from eviction.sketch_plan import read_channels, read_channels_ref
from tests.eviction.test_sketch_kernel import DEVICE, make_case


@pytest.mark.parametrize("num_tokens,block_tokens,num_kv_heads,group,head_dim,channels", [
    (37, 16, 2, 3, 64, 16),  # partial tail, odd group
    (96, 32, 1, 4, 128, 32),  # full blocks, llama3 head size, no second kv head
    (50, 24, 2, 1, 32, 16),  # even block size that is not a power of two, no GQA
    (9, 64, 3, 2, 64, 64),  # one partial block, every channel read
    (19 * 64 - 3, 64, 2, 4, 128, 16),  # llama3-8b's group and blocks, 19 blocks (programs run past the end)
    (40 * 16 - 3, 16, 2, 1, 64, 16),  # no GQA, many blocks a program: miscompiled on sm_90 unless the group is padded
    (21 * 64 - 5, 64, 2, 4, 128, 48),  # a channel count that is no power of two (Triton pads it to 64)
    (45, 16, 1, 3, 64, 48),
])
def test_kernel_matches_reference(num_tokens, block_tokens, num_kv_heads, group, head_dim, channels) -> None:
    q, summaries, codes, keys = make_case(num_tokens, block_tokens, num_kv_heads, group, head_dim, seed=num_tokens)
    want = channel_block_stats_ref(q, summaries, codes, num_tokens, channels)
    for per_program, warps in ((1, 4), (4, 1), (16, 1), (16, 4)):
        got = channel_block_stats(q, summaries, codes, num_tokens, channels, blocks_per_program=per_program,
                                  decode=per_program % 2, num_warps=warps)
        for w, g in zip(want, got):
            assert g.shape == (num_kv_heads * group, summaries.shape[0]) and g.dtype == torch.float32
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)
    true = true_block_lse(q, keys, block_tokens)
    assert (got[1] >= true).all() and (want[1] >= true).all()


def test_blocks_outside_valid_hold_garbage() -> None:
    q, summaries, codes, keys = make_case(7 * 32, 32, 2, 4, 64, seed=5)
    valid = torch.tensor([True, True, False, True, False, True, True], device=DEVICE)
    summaries[2], summaries[4] = float("nan"), float("inf")
    codes[2] = 255
    want = channel_block_stats_ref(q, summaries, codes, keys.shape[0], 16, valid)
    got = channel_block_stats(q, summaries, codes, keys.shape[0], 16, valid, blocks_per_program=2)
    for w, g in zip(want, got):
        assert bool((g[:, ~valid] == float("-inf")).all())
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)


def _adversarial_keys(q: torch.Tensor, read: torch.Tensor, num_blocks: int, block_tokens: int,
                      g: torch.Generator) -> torch.Tensor:
    """[num_blocks * block_tokens, D]: per block two pins set every channel's min and max, and one token sits at
    the box's corner that maximizes q on the unread channels (the bound's worst case there) and 0.45 of a step
    off its grid point in q's favour on the read ones (0.5 less fp16 rounding: the estimate's worst case)."""
    head_dim = q.shape[0]
    blocks = []
    for _ in range(num_blocks):
        low, high = -1 - torch.rand(head_dim, generator=g), 1 + torch.rand(head_dim, generator=g)
        step = (high - low) / 15
        grid = low + step * torch.randint(1, 15, (head_dim,), generator=g).float()
        best = torch.where(read, grid + 0.45 * step * torch.sign(q), torch.where(q > 0, high, low))
        rest = low + (high - low) * torch.rand(block_tokens - 3, head_dim, generator=g)
        blocks.append(torch.cat((low[None], high[None], best[None], rest)))
    return torch.cat(blocks)


@pytest.mark.parametrize("scale,key_scale", [(1.0, 1.0), (30.0, 1.0), (300.0, 300.0)])  # the last: q * step
def test_bound_holds_against_adversarial_blocks(scale, key_scale) -> None:  # overflows fp16, Quest alone bounds
    """Large |q| in a few channels (the read ones), norm-matched needles along q, keys at the bound's worst
    corner, constant blocks (zero step)."""
    g = torch.Generator().manual_seed(2)
    head_dim, block_tokens, channels = 64, 16, 16
    q = torch.randn(head_dim, generator=g)
    q[:3] *= 20.0  # a few dominant channels
    read = torch.zeros(head_dim, dtype=torch.bool)
    read[read_channels_ref(q.half()[None], 1, channels)[0]] = True
    keys = _adversarial_keys(q, read, 12, block_tokens, g) * key_scale
    norm = keys.norm(dim=-1).median()
    for pos in (40, 100, 150):
        keys[pos] = q / q.norm() * norm  # a needle: aligned, never extreme in any channel
    keys[16 * 5: 16 * 7] = 0.25  # two constant blocks
    keys = torch.cat((keys, torch.randn(5, head_dim, generator=g)))[:, None].half()  # [T, 1, D], a partial tail
    summaries, codes = sketch_keys(keys, block_tokens)
    qh = (q * scale).half()[None].to(DEVICE)
    true = true_block_lse(qh, keys.to(DEVICE), block_tokens)
    for stats in (channel_block_stats, channel_block_stats_ref):
        lse, upper = stats(qh, summaries.to(DEVICE), codes.to(DEVICE), keys.shape[0], channels)
        assert bool((upper >= true).all()), (upper - true).min()
        assert bool(torch.isfinite(upper).all())


def test_bad_arguments_raise() -> None:
    q, summaries, codes, keys = make_case(64, 16, 2, 2, 64, seed=1)
    with pytest.raises(ValueError, match="num_channels"):
        channel_block_stats_ref(q, summaries, codes, 64, 0)
    with pytest.raises(ValueError, match="multiple of 16"):
        channel_block_stats(q, summaries, codes, 64, 24)
    with pytest.raises(ValueError, match="blocks_per_program"):
        channel_block_stats(q, summaries, codes, 64, 16, blocks_per_program=3)
    with pytest.raises(ValueError, match="valid"):
        channel_block_stats_ref(q, summaries, codes, 64, 16, torch.ones(3, dtype=torch.bool, device=DEVICE))


@pytest.mark.parametrize("num_tokens,block_tokens,num_kv_heads,group,head_dim,channels", [
    (37, 16, 2, 3, 64, 16),
    (19 * 64 - 3, 64, 2, 4, 128, 64),
])
def test_pairs_read_adjacent_channel_pairs_and_match_reference(num_tokens, block_tokens, num_kv_heads, group,
                                                               head_dim, channels) -> None:
    q, summaries, codes, keys = make_case(num_tokens, block_tokens, num_kv_heads, group, head_dim, seed=num_tokens)
    idx = read_channels_ref(q, num_kv_heads, channels, pairs=True)
    assert idx.shape == (num_kv_heads, channels) and bool((idx[:, 1::2] == idx[:, ::2] + 1).all())
    assert bool((idx[:, ::2] % 2 == 0).all())
    importance = q.float().abs().view(num_kv_heads, group, head_dim).sum(1).view(num_kv_heads, -1, 2).sum(-1)
    chosen = importance.gather(1, idx[:, ::2] // 2)  # every chosen pair ranks above every other
    others = importance.masked_fill(torch.zeros_like(importance, dtype=torch.bool).scatter_(1, idx[:, ::2] // 2, True),
                                    float("-inf"))
    assert bool((chosen.min(1).values >= others.max(1).values).all())
    want = channel_block_stats_ref(q, summaries, codes, num_tokens, channels, pairs=True)
    got = channel_block_stats(q, summaries, codes, num_tokens, channels, pairs=True)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=2e-4)
    assert bool((got[1] >= true_block_lse(q, keys, block_tokens)).all())
    with pytest.raises(ValueError, match="even num_channels"):
        channel_block_stats_ref(q, summaries, codes, num_tokens, 15, pairs=True)


@pytest.mark.parametrize("pairs", [False, True])
@pytest.mark.parametrize("num_kv_heads,group,head_dim,channels", [(2, 3, 64, 16), (3, 4, 128, 64), (2, 4, 128, 48),
                                                             (1, 1, 32, 32)])
def test_plan_kernel_picks_the_reference_channels_ascending(pairs, num_kv_heads, group, head_dim, channels) -> None:
    """The launch the kernels read their channels from: the reference's set in its ascending order (the CUDA first
    level copies code rows in this order), ties included: the lower channel (pair) wins."""
    g = torch.Generator().manual_seed(head_dim + channels)
    q = torch.randint(-2, 3, (num_kv_heads * group, head_dim), generator=g).half().to(DEVICE)  # ties everywhere
    got = read_channels(q, num_kv_heads, channels, pairs)
    want = read_channels_ref(q, num_kv_heads, channels, pairs)
    assert got.dtype == torch.int32 and torch.equal(got.long(), want)
    assert bool((got[:, 1:] > got[:, :-1]).all())
