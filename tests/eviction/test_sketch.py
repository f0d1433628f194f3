"""The 4-bit key sketch: packing, its rounding bound, and token-by-token growth."""

from __future__ import annotations

import pytest
import torch

from eviction.sketch import KeySketch, grid_steps, pack, sketch_keys, token_estimates_ref, unpack
from eviction.summaries import summarize_keys


def _keys(num_tokens: int, num_kv_heads: int, head_dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    keys[..., :4] *= 8.0  # a few high-variance channels, as real keys have
    return (keys + torch.randn(head_dim, generator=g)).half()  # [T, H, D]


def test_pack_round_trips_and_splits_planes() -> None:
    codes = torch.randint(0, 16, (3, 5, 7, 32), generator=torch.Generator().manual_seed(0))
    packed = pack(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 2, 7, 8)
    assert torch.equal(unpack(packed, planes=2), codes.float())
    assert torch.equal(unpack(packed, planes=1), (codes >> 2 << 2).float())


@pytest.mark.parametrize("num_tokens,block_tokens,num_kv_heads,head_dim", [(1, 16, 1, 64), (77, 16, 3, 64),
                                                                             (130, 32, 2, 128), (64, 64, 1, 8)])
def test_dequantized_keys_lie_within_half_a_step(num_tokens, block_tokens, num_kv_heads, head_dim) -> None:
    keys = _keys(num_tokens, num_kv_heads, head_dim, seed=num_tokens)
    summaries, codes = sketch_keys(keys, block_tokens)
    assert torch.equal(summaries, summarize_keys(keys, block_tokens))
    num_blocks = summaries.shape[0]
    assert codes.shape == (num_blocks, num_kv_heads, 2, block_tokens, head_dim // 4)
    low, step = grid_steps(summaries)  # [N, H, D]
    k_hat = low[:, None] + step[:, None] * unpack(codes).transpose(1, 2)  # [N, B, H, D]
    error = (k_hat.flatten(0, 1)[:num_tokens] - keys.float()).abs()
    bound = step.repeat_interleave(block_tokens, 0)[:num_tokens] / 2
    assert (error <= bound * (1 + 1e-5) + 1e-6).all()
    assert (unpack(codes).transpose(1, 2).flatten(0, 1)[num_tokens:] == 0).all()  # padding: code 0


def test_token_estimates_bound_every_true_logit() -> None:
    keys, q = _keys(200, 2, 64, seed=1), torch.randn(6, 64, generator=torch.Generator().manual_seed(2)).half()
    summaries, codes = sketch_keys(keys, 16)
    true = torch.einsum("hgd,thd->hgt", q.float().view(2, 3, 64), keys.float()).flatten(0, 1)  # [Hq, T]
    for planes in (1, 2):
        est, err = token_estimates_ref(q, summaries, codes, planes)  # [Hq, N, B], [Hq, N]
        gap = (est.flatten(1)[:, :200] - true).abs()
        assert (gap <= err.repeat_interleave(16, 1)[:, :200]).all()
    fine_err, coarse_err = token_estimates_ref(q, summaries, codes, 2)[1], token_estimates_ref(q, summaries, codes, 1)[1]
    assert (coarse_err > 3 * fine_err).all()  # the high plane alone is 4x coarser


def test_token_by_token_growth_matches_one_shot() -> None:
    keys = _keys(101, 3, 64, seed=3)
    grown = KeySketch(3, 64, 16)
    for start, size in ((0, 1), (1, 20), (21, 11), (32, 1), (33, 1), (34, 67)):
        grown.append(keys[start:start + size])
        summaries, codes = sketch_keys(keys[: start + size], 16)
        assert grown.num_tokens == start + size and grown.num_blocks == summaries.shape[0]
        assert torch.equal(grown.summaries, summaries) and torch.equal(grown.codes, codes)
    assert grown.tail.shape[0] == 101 % 16


def test_constant_channels_get_code_zero_and_exact_estimates() -> None:
    keys = torch.full((40, 1, 8), 0.75).half()
    summaries, codes = sketch_keys(keys, 16)
    assert (codes == 0).all()
    est, err = token_estimates_ref(torch.ones(2, 8).half(), summaries, codes)
    assert torch.allclose(est, torch.full_like(est, 6.0)) and (err < 1e-2).all()


def test_bad_input_raises() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        sketch_keys(torch.randn(10, 1, 6).half(), 4)
    with pytest.raises(ValueError, match="keys"):
        KeySketch(2, 64, 16).append(torch.randn(3, 1, 64).half())
    with pytest.raises(ValueError, match="block_tokens"):
        KeySketch(2, 64, 0)
