"""The one-launch decode append against its torch reference, on irregular shapes (TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import pytest
import torch

from kvstore.append_kernel import append_token, append_token_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("heads, block_tokens, head_dim, num_tokens", [(3, 16, 64, 0), (8, 64, 128, 1000),
                                                                       (1, 32, 32, 31), (5, 8, 16, 64)])
def test_append_matches_reference(heads, block_tokens, head_dim, num_tokens):
    g = torch.Generator().manual_seed(num_tokens)
    pool = torch.randn((7, 2, heads, block_tokens, head_dim), generator=g).half().to(DEVICE)
    summaries = torch.randn((num_tokens // block_tokens + 3, 2, heads, head_dim), generator=g).half().to(DEVICE)
    k, v = (torch.randn((heads, head_dim), generator=g).half().to(DEVICE) for _ in range(2))
    slot = torch.tensor([5], device=DEVICE)
    count = torch.tensor([num_tokens], device=DEVICE)
    want_pool, want_summaries = pool.clone(), summaries.clone()
    append_token_ref(want_pool, want_summaries, k, v, slot, count)
    append_token(pool, summaries, k, v, slot, count)
    assert torch.equal(pool, want_pool) and torch.equal(summaries, want_summaries)
    offset, block = num_tokens % block_tokens, num_tokens // block_tokens
    assert torch.equal(pool[5, 0, :, offset], k) and torch.equal(pool[5, 1, :, offset], v)
    assert bool((summaries[block, 0] <= k).all() and (summaries[block, 1] >= k).all())


def test_append_checks_its_inputs():
    pool = torch.zeros((2, 2, 2, 8, 16), dtype=torch.float16)
    summaries = torch.zeros((4, 2, 2, 16), dtype=torch.float16)
    k = torch.zeros((2, 16), dtype=torch.float16)
    one = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="num_tokens"):
        append_token_ref(pool, summaries, k, k, one, one.int())
    with pytest.raises(ValueError, match="pool"):
        append_token_ref(pool.float(), summaries, k, k, one, one)
    with pytest.raises(ValueError, match="k, v"):
        append_token_ref(pool, summaries, k, k.float(), one, one)
