"""The sketch selector's ranking (each block's share of each head's estimated softmax, group mean): kernels against
the torch reference on irregular shapes (under TRITON_INTERPRET=1 without a GPU)."""

from __future__ import annotations

import pytest
import torch

from eviction.sketch_rank import block_shares, block_shares_ref
from eviction.sketch_topk import block_mass

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("num_blocks,num_kv_heads,group", [(1, 1, 1), (37, 2, 3), (2500, 3, 4), (1024, 1, 2)])
def test_kernels_match_reference(num_blocks, num_kv_heads, group) -> None:
    g = torch.Generator().manual_seed(num_blocks)
    lse = (torch.randn(num_kv_heads * group, num_blocks, generator=g) * 4).to(DEVICE)
    valid = (torch.rand(num_blocks, generator=g) > 0.2).to(DEVICE)  # holes: each block before one is a tail
    lse[:, ~valid] = float("nan")  # garbage outside valid
    keep = (torch.rand(num_blocks, generator=g) > 0.9).to(DEVICE)
    for v in (valid, None):
        want = block_shares_ref(lse.nan_to_num(0.0) if v is None else lse, keep, v, num_kv_heads)
        got = block_shares(lse.nan_to_num(0.0) if v is None else lse, keep, v, num_kv_heads)
        for w, x in zip(want, got):
            assert not bool(x.isnan().any())
            torch.testing.assert_close(x, w, rtol=1e-5, atol=1e-7)


def test_shares_are_the_group_mean_of_softmax_over_ranked_blocks() -> None:
    lse = torch.tensor([[0.0, 1.0, 2.0, 5.0, 9.0], [3.0, 0.0, 0.0, 0.0, 9.0]], device=DEVICE)  # 1 kv head, 2 q heads
    valid = torch.tensor([True, True, True, True, True], device=DEVICE)
    keep = torch.tensor([True, False, False, False, False], device=DEVICE)
    for shares in (block_shares, block_shares_ref):
        scores, z = shares(lse, keep, valid, 1)
        ranked = lse[:, :4]  # the last live block is the tail: left out of z, scores 0 unless kept
        torch.testing.assert_close(z, ranked.logsumexp(1))
        torch.testing.assert_close(scores[0, 1:4], block_mass(ranked, 1)[0, 1:4])
        assert scores[0, 0] == float("inf") and scores[0, 4] == 0.0


def test_nothing_ranked_gives_zero_shares() -> None:
    lse = torch.randn(2, 3, device=DEVICE)
    valid = torch.tensor([False, False, True], device=DEVICE)  # the one live block is a tail
    keep = torch.zeros(3, dtype=torch.bool, device=DEVICE)
    for shares in (block_shares, block_shares_ref):
        scores, z = shares(lse, keep, valid, 1)
        assert scores.tolist() == [[float("-inf"), float("-inf"), 0.0]] and bool((z == float("-inf")).all())


def test_bad_input_raises() -> None:
    lse = torch.randn(4, 8, device=DEVICE)
    keep = torch.zeros(8, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="lse"):
        block_shares(lse.half(), keep, None, 2)
    with pytest.raises(ValueError, match="keep"):
        block_shares_ref(lse, keep[:3], None, 2)
    with pytest.raises(ValueError, match="lse"):
        block_shares_ref(lse, keep, None, 3)
