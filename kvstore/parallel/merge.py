"""Partial attention of the ranks -> the sequence's attention: the flash-decoding split merge across ranks.

Rank r attended its shard and holds out_r [Hq, D] (softmax-normalized over what it attended) and lse_r [Hq]
(natural log-sum-exp of its scaled logits; -inf where it attended nothing). The sequence's output is
sum_r exp(lse_r - lse) * out_r with lse = logsumexp_r lse_r: exactly how kvstore.attention.merge merges the
splits of one row, so the ranks are handed to it as splits (its Triton kernel on CUDA, merge_splits_ref on CPU).
"""

from __future__ import annotations

import math

import torch

from kvstore.attention.plan import DecodeGeometry
from kvstore.attention.reference import merge_splits_ref


def merge_partials(outs: torch.Tensor, lse: torch.Tensor, use_kernel: bool | None = None) -> torch.Tensor:
    """outs float [R, Hq, D], lse float [R, Hq] (natural log) -> fp16 [Hq, D]. use_kernel None: the Triton
    merge on CUDA, its torch reference elsewhere (True on the CPU: the kernel under TRITON_INTERPRET=1, tests)."""
    if outs.dim() != 3 or lse.shape != outs.shape[:2]:
        raise ValueError(f"need outs [R, Hq, D] and lse [R, Hq], got {list(outs.shape)} and {list(lse.shape)}")
    num_ranks, num_q_heads, head_dim = outs.shape
    o_part = outs.float().permute(1, 0, 2)[None].contiguous()  # [1, Hq, R, D]: the ranks as splits
    lse_part = (lse.float().t()[None] / math.log(2)).contiguous()  # [1, Hq, R], base 2 as the splits keep it
    no_tokens = torch.zeros(1, dtype=torch.int32, device=outs.device)  # no block mass: read by neither merge
    if outs.is_cuda if use_kernel is None else use_kernel:
        from kvstore.attention.merge import merge_splits

        geom = DecodeGeometry(batch=1, num_q_heads=num_q_heads, num_kv_heads=num_q_heads, head_dim=head_dim,
                              block_tokens=1, max_blocks=1)
        return merge_splits(o_part, lse_part, lse_part, no_tokens, geom, return_block_mass=False)[0][0]
    lse_block = torch.zeros((1, num_q_heads, 1), device=outs.device)
    return merge_splits_ref(o_part, lse_part, lse_block, no_tokens, 1, num_q_heads)[0][0]


def rank_weights(lse: torch.Tensor) -> torch.Tensor:
    """lse [R, Hq] -> float32 [R, Hq]: each rank's share of every q head's softmax, exp(lse_r - lse)."""
    total = torch.logsumexp(lse.float(), dim=0)  # [Hq]
    return torch.exp(lse.float() - total).nan_to_num(0.0)
