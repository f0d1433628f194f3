"""Which channels the sketch's first level reads (eviction/sketch_channels.py): per kv head, the r channels of
largest |q_d| summed over the GQA group (SparQ, Ribar et al. 2023), ties to the lower channel; or, with pairs, the
r / 2 adjacent pairs (2p, 2p + 1) of largest summed importance (64-byte code rows at 64-token blocks, which the
gather reads at less cost; one of 241 needles lost at 1M: BENCHMARKS.md, Sketch selector).

The list is ascending, not by rank: the CUDA first level (eviction/sketch_mma.cu) copies the chosen code rows in
list order, and ascending rows let a warp's copy instruction walk each block's rows in address order, neighbours
sharing 128-byte lines (156 against 167 us at 1M, r = 64: BENCHMARKS.md, Sketch selector). The kernels' dot products do
not care in which order they sum.

Layout: kernel -> launcher -> pure-torch reference. Imports only torch and triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _plan_kernel(q_ptr, ch_ptr, stride_qh, stride_ch, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                 HEAD_DIM: tl.constexpr, CHANNELS: tl.constexpr, PAIRS: tl.constexpr):
    """One program per kv head: the CHANNELS channels of largest sum_g |q_gd| (ties: the lower channel), ascending;
    PAIRS: the CHANNELS / 2 adjacent pairs (2p, 2p + 1) of largest summed importance, both channels of a pair."""
    head = tl.program_id(0)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (head * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :], mask=(offs_g < GROUP)[:, None],
                other=0.0)
    importance = tl.sum(tl.abs(q.to(tl.float32)), 0)  # [HEAD_DIM]
    if PAIRS:
        offs_p = tl.arange(0, HEAD_DIM // 2)
        pair = tl.sum(tl.reshape(importance, (HEAD_DIM // 2, 2)), 1)  # [HEAD_DIM / 2]
        ahead = (pair[None, :] > pair[:, None]) | ((pair[None, :] == pair[:, None])
                                                  & (offs_p[None, :] < offs_p[:, None]))
        chosen = tl.sum(ahead.to(tl.int32), 1) < CHANNELS // 2  # [HEAD_DIM / 2]: fewer pairs ahead than taken
        at = 2 * (tl.cumsum(chosen.to(tl.int32), 0) - 1)  # its place: two channels per chosen pair before it
        tl.store(ch_ptr + head * stride_ch + at, 2 * offs_p, mask=chosen)
        tl.store(ch_ptr + head * stride_ch + at + 1, 2 * offs_p + 1, mask=chosen)
    else:
        ahead = (importance[None, :] > importance[:, None]) | ((importance[None, :] == importance[:, None])
                                                              & (offs_d[None, :] < offs_d[:, None]))
        chosen = tl.sum(ahead.to(tl.int32), 1) < CHANNELS  # [HEAD_DIM]: fewer channels ahead than taken
        tl.store(ch_ptr + head * stride_ch + tl.cumsum(chosen.to(tl.int32), 0) - 1, offs_d, mask=chosen)


def read_channels(q: torch.Tensor, num_kv_heads: int, num_channels: int, pairs: bool = False) -> torch.Tensor:
    """int32 [H, num_channels]: `read_channels_ref`'s channels, ascending, from one small launch (no host sync)."""
    group, head_dim = q.shape[0] // num_kv_heads, q.shape[1]
    channels = torch.empty(num_kv_heads, num_channels, dtype=torch.int32, device=q.device)
    _plan_kernel[(num_kv_heads,)](q, channels, q.stride(0), channels.stride(0), GROUP=group,
                                  GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim, CHANNELS=num_channels,
                                  PAIRS=pairs)
    return channels


def read_channels_ref(q: torch.Tensor, num_kv_heads: int, num_channels: int, pairs: bool = False) -> torch.Tensor:
    """int64 [H, num_channels] ascending: the channels of largest sum_g |q_gd| per kv head (ties: the lower one);
    pairs: the num_channels / 2 adjacent pairs (2p, 2p + 1) of largest summed importance."""
    importance = q.float().abs().view(num_kv_heads, -1, q.shape[1]).sum(1)  # [H, D]
    if pairs:
        pair = importance.view(num_kv_heads, -1, 2).sum(-1)  # [H, D / 2]
        order = torch.sort(pair, dim=1, descending=True, stable=True).indices[:, :num_channels // 2]
        order = torch.stack((2 * order, 2 * order + 1), -1).flatten(1)
        return torch.sort(order, dim=1).values
    order = torch.sort(importance, dim=1, descending=True, stable=True).indices[:, :num_channels]
    return torch.sort(order, dim=1).values
