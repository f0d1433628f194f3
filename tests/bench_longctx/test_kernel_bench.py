"""The kernel benchmark's fp8 and int4 cases: the pools it times are the fp16 blocks quantized to that
format, which paged_decode reads as its torch reference does."""

from __future__ import annotations

import pytest
import torch

from bench_longctx.kernel_bench import CASES, HEAD_DIM, NUM_KV_HEADS, bytes_read, case_args, make_pools
from kvstore.attention.paged_decode import paged_decode
from kvstore.attention.reference import paged_decode_ref
from tiers.layout import BlockLayout, QuantBlocks
from tiers.quant import dequantize, error_bound


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quantized_cases_read_their_format_like_the_reference(fmt):
    assert fmt in CASES
    torch.manual_seed(0)
    block_tokens, num_blocks = 32, 5
    pools = make_pools(num_blocks * block_tokens, block_tokens, torch.device("cpu"))
    q = torch.randn((1, 32, HEAD_DIM), dtype=torch.float16)  # [1, Hq, D]
    args = case_args(pools, fmt, q)
    layout = BlockLayout(NUM_KV_HEADS, block_tokens, HEAD_DIM, fmt)
    warm = QuantBlocks(*args[2:5])
    layout.check(warm, fmt)
    assert warm.fmt == fmt and len(warm) == num_blocks and args[1].shape[0] == 0  # warm pool only
    # the fp16 blocks themselves, quantized: within the format's bound of them
    assert ((dequantize(warm, torch.float32) - pools["hot"].float()).abs() <= error_bound(pools["hot"], fmt)).all()
    got, _ = paged_decode(*args)
    want, _ = paged_decode_ref(*args)
    torch.testing.assert_close(got.float(), want.float(), atol=5e-3, rtol=5e-3)
    assert bytes_read(fmt, num_blocks * block_tokens, block_tokens) == num_blocks * layout.bytes_for(fmt)
