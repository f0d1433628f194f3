"""The certified omitted mass of eviction/certify.py in one launch: a program per q head, one pass over its bounds.

certify.py's torch form masks the attended blocks out of block_upper [Hq, N], takes a log-sum-exp and a
sigmoid: a mask, a scatter, a repeat, a masked fill, a reduction in several launches and a sigmoid per
layer of a decode step (228 us at 1M tokens on the H200, where the bounds are one read of 2 MB; this kernel
13 us: BENCHMARKS.md, Sketch selector). Here the terms
are taken relative to the attended log-sum-exp L_i, which the kernel knows before it starts, so they add up
in any order, and the attended blocks are subtracted instead of masked:
    S = sum_{every b} t_b - sum_{b in A} t_b,   t_b = exp(min(U_ib - L_i, 80)),   bound_i = S / (1 + S).
Each t_b is computed by one helper from the same fp32 inputs in both sums (bitwise the same value), and the
sums are fp64, so the difference is the left-out blocks' sum up to fp64 rounding, (N + k + 2) 2^-52 of the
total, added back. A term capped at e^80 is a left-out block whose mass alone bounds the step at 1 - 2^-115
(an attended one is capped alike in both sums); a term that underflows fp32 (U_ib < L_i - 87) loses
< 2^-126, N of which are added back. The result is never below certify.py's up to fp32 rounding.

Layout: kernel -> launcher. Imports only torch and triton; the torch form and its contract are certify.py's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CAP = 80.0  # nats above L_i a term may reach: e^80 in fp32, N of them in fp64
# bounds per step of the pass and launch options: fastest at 1M tokens on the H200 (13 us a layer, llama3-8b,
# k = 64): BENCHMARKS.md, Sketch selector
DEFAULT_KNOBS = dict(chunk=4096, num_warps=8, num_stages=3)


@triton.jit
def _term(u, lse):
    """exp(min(u - lse, CAP)) in fp32; 0 for u = -inf (a dead block), whatever lse is."""
    d = tl.where(u == float("-inf"), float("-inf"), u - lse)
    return tl.exp(tl.minimum(d, 80.0))


@triton.jit(do_not_specialize=["num_blocks", "k"])
def _omitted_kernel(upper_ptr, sel_ptr, lse_ptr, out_ptr, num_blocks, k, stride_uh, stride_sh, stride_sk,
                    GROUP: tl.constexpr, K_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Program i (a q head): out[i] = the bound on the softmax mass outside q head i's attended blocks."""
    i = tl.program_id(0)
    row = upper_ptr + i.to(tl.int64) * stride_uh
    lse = tl.load(lse_ptr + i)
    offs_k = tl.arange(0, K_PAD)
    sel = tl.load(sel_ptr + (i // GROUP) * stride_sh + offs_k * stride_sk, mask=offs_k < k, other=0)
    attended = tl.sum(_term(tl.load(row + sel, mask=offs_k < k, other=float("-inf")), lse).to(tl.float64), 0)
    total = tl.zeros([CHUNK], tl.float64)
    for c0 in range(0, num_blocks, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        total += _term(tl.load(row + offs, mask=offs < num_blocks, other=float("-inf")), lse).to(tl.float64)
    every = tl.sum(total, 0)
    rounding = (num_blocks + K_PAD + 2) * 2.220446049250313e-16 * every  # 2^-52 per addition, generously
    left = tl.maximum(every - attended, 0.0) + rounding + num_blocks * 1.1754943508222875e-38  # + 2^-126 each
    tl.store(out_ptr + i, (left / (1.0 + left)).to(tl.float32))


def omitted_mass_bounds_kernel(block_upper: torch.Tensor, selected: torch.Tensor, attended_lse: torch.Tensor,
                               out: torch.Tensor | None = None, **knobs: int) -> torch.Tensor:
    """float32 [Hq]: per q head, the certified bound of certify.omitted_mass_bounds (same contract), one launch;
    written into out (float32 [Hq], contiguous) when given. Sync-free: capturable in a CUDA graph.
    knobs (chunk: a power of two, num_warps, num_stages) override DEFAULT_KNOBS."""
    unknown = set(knobs) - set(DEFAULT_KNOBS)
    if unknown:
        raise ValueError(f"unknown knobs {sorted(unknown)}; expected some of {sorted(DEFAULT_KNOBS)}")
    knobs = {**DEFAULT_KNOBS, **knobs}
    num_q_heads, num_blocks = block_upper.shape
    group = num_q_heads // selected.shape[0]
    if block_upper.dtype != torch.float32 or block_upper.stride(1) != 1 or attended_lse.dtype != torch.float32:
        raise ValueError(f"block_upper: expected float32 with a contiguous last dim and attended_lse float32, got "
                         f"{block_upper.dtype} strides {block_upper.stride()} and {attended_lse.dtype}")
    if out is None:
        out = torch.empty(num_q_heads, dtype=torch.float32, device=block_upper.device)
    elif out.shape != (num_q_heads,) or out.dtype != torch.float32 or out.stride(0) != 1:
        raise ValueError(f"out: expected contiguous float32 [{num_q_heads}], got {out.dtype} {list(out.shape)}")
    lse = attended_lse.contiguous()
    _omitted_kernel[(num_q_heads,)](
        block_upper, selected, lse, out, num_blocks, selected.shape[1], block_upper.stride(0), selected.stride(0),
        selected.stride(1), GROUP=group, K_PAD=triton.next_power_of_2(max(selected.shape[1], 1)), CHUNK=knobs["chunk"],
        num_warps=knobs["num_warps"], num_stages=knobs["num_stages"],
    )
    return out
