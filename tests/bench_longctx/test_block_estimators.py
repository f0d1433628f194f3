"""The 1-bit estimator of the selection bench: RaBitQ's estimate of q . k from rotated sign codes tracks the exact
logits, is exact where a key equals its block's mean (centred), and ranks blocks by estimated mass."""

from __future__ import annotations

import torch

from bench_longctx.block_estimators import scorers, sign_estimates


def keys_and_query(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys = (torch.randn(200, 2, 64, generator=g) * torch.linspace(0.2, 3, 64) + 0.5).half()  # [T, H, D]
    return keys, torch.randn(6, 64, generator=g).half()  # 3 q heads per kv head


def test_sign_estimates_track_the_exact_logits():
    keys, q = keys_and_query()
    exact = torch.einsum("hgd,thd->hgt", q.float().view(2, 3, 64), keys.float()).flatten(0, 1)
    for centered in (False, True):
        est = sign_estimates(q, keys, 32, centered)
        assert est.shape == exact.shape
        assert torch.corrcoef(torch.stack([est.flatten(), exact.flatten()]))[0, 1] > 0.7, centered


def test_a_key_equal_to_its_block_mean_is_estimated_exactly_when_centred():
    keys, q = keys_and_query(1)
    keys[:32] = keys[0]  # the first block: one key repeated, no residual
    exact = torch.einsum("hgd,thd->hgt", q.float().view(2, 3, 64), keys.float()).flatten(0, 1)
    est = sign_estimates(q, keys, 32, centered=True)
    torch.testing.assert_close(est[:, :32], exact[:, :32], atol=0.05, rtol=0.01)


def test_block_scores_are_mass_shares():
    keys, q = keys_and_query(2)
    for name in ("sign1_mass", "sign1_centered_mass"):
        scores = scorers()[name](q, keys, 32, 0.125)  # [H, N]: each head's estimated softmax per block
        assert scores.shape == (2, 7)
        torch.testing.assert_close(scores.sum(1), torch.ones(2))
