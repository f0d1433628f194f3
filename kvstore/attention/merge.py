"""The merge step of flash-decoding for kvstore.attention.paged_decode: splits -> output and block mass.

The split kernel leaves, per (row, q head, split), the split's normalized output and its
log2-sum-exp2, and per (row, q head, block) the block's log2-sum-exp2. `_combine_kernel`
weights the splits by exp2(lse_split - lse) and keeps lse; `_block_mass_kernel` turns
block log-sums into softmax mass, averaged over each GQA group's q heads (what H2O adds up).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstore.attention.plan import DecodeGeometry

_SPLIT_CHUNK = 32  # splits merged per step of _combine_kernel
_MASS_CHUNK = 256  # blocks per program of _block_mass_kernel


@triton.jit
def _combine_kernel(
    o_part_ptr, lse_part_ptr, out_ptr, lse_ptr, s_out_batch, s_out_head, num_q_heads, num_splits,
    HEAD_DIM: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
):
    """out[b, qh] = sum over splits of o_part weighted by exp2(lse_part - lse); lse kept for the mass."""
    b = tl.program_id(0)
    qh = tl.program_id(1)
    row = b * num_q_heads + qh
    offs_s = tl.arange(0, SPLIT_CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    lse_max = tl.full([SPLIT_CHUNK], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, SPLIT_CHUNK):  # pass 1: the max, so pass 2 has no rescaling chain
        lse = tl.load(lse_part_ptr + row * num_splits + s0 + offs_s, mask=s0 + offs_s < num_splits, other=float("-inf"))
        lse_max = tl.maximum(lse_max, lse)
    m = tl.max(lse_max, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights 0, out 0
    w_sum = tl.zeros([SPLIT_CHUNK], tl.float32)
    acc = tl.zeros([SPLIT_CHUNK, HEAD_DIM], tl.float32)
    for s0 in range(0, num_splits, SPLIT_CHUNK):
        s_ok = s0 + offs_s < num_splits
        part = row * num_splits + s0 + offs_s  # [S]
        w = tl.exp2(tl.load(lse_part_ptr + part, mask=s_ok, other=float("-inf")) - m)
        o = tl.load(o_part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0)
        acc += w[:, None] * o
        w_sum += w
    total = tl.sum(w_sum, 0)
    out = tl.sum(acc, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * s_out_batch + qh * s_out_head + offs_d, out.to(tl.float16))
    tl.store(lse_ptr + row, tl.where(total > 0, m + tl.log2(tl.where(total > 0, total, 1.0)), float("-inf")))


@triton.jit
def _block_mass_kernel(
    lse_block_ptr, lse_ptr, num_tokens_ptr, mass_ptr, num_kv_heads, max_blocks,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_TOKENS: tl.constexpr, MASS_CHUNK: tl.constexpr,
):
    """mass[b, h, j] = mean over the group's q heads of exp2(lse_block - lse); 0 past the used blocks."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_j = tl.program_id(2) * MASS_CHUNK + tl.arange(0, MASS_CHUNK)
    offs_g = tl.arange(0, GROUP_PAD)
    n_blocks = tl.cdiv(tl.load(num_tokens_ptr + b), BLOCK_TOKENS)
    ok = (offs_g < GROUP)[:, None] & (offs_j < n_blocks)[None, :]  # [G, C]
    rows = b * num_kv_heads * GROUP + head * GROUP + offs_g  # [G]
    lse = tl.load(lse_ptr + rows, mask=offs_g < GROUP, other=0.0)
    lse_block = tl.load(lse_block_ptr + rows[:, None] * max_blocks + offs_j[None, :], mask=ok, other=0.0)
    mass = tl.sum(tl.where(ok, tl.exp2(lse_block - lse[:, None]), 0.0), 0) / GROUP
    tl.store(mass_ptr + (b * num_kv_heads + head) * max_blocks + offs_j, mass, mask=offs_j < max_blocks)


def merge_splits(
    o_part: torch.Tensor, lse_part: torch.Tensor, lse_block: torch.Tensor, num_tokens: torch.Tensor,
    geom: DecodeGeometry, return_block_mass: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """o_part f32 [B, Hq, S, D], lse_part f32 [B, Hq, S], lse_block f32 [B, Hq, max_blocks] (read only with
    return_block_mass) -> (out fp16 [B, Hq, D], block mass f32 [B, H, max_blocks] or None)."""
    b, nq, num_splits, d = o_part.shape
    out = torch.empty((b, nq, d), dtype=torch.float16, device=o_part.device)  # [B, Hq, D]
    lse = torch.empty((b, nq), dtype=torch.float32, device=o_part.device)  # [B, Hq]
    _combine_kernel[(b, nq)](o_part, lse_part, out, lse, out.stride(0), out.stride(1), nq, num_splits,
                             HEAD_DIM=d, SPLIT_CHUNK=_SPLIT_CHUNK, num_warps=4, num_stages=3)
    if not return_block_mass:
        return out, None
    h, max_blocks = geom.num_kv_heads, geom.max_blocks
    mass = torch.empty((b, h, max_blocks), dtype=torch.float32, device=o_part.device)  # [B, H, max_blocks]
    _block_mass_kernel[(b, h, triton.cdiv(max_blocks, _MASS_CHUNK))](
        lse_block, lse, num_tokens, mass, h, max_blocks, GROUP=geom.group,
        GROUP_PAD=triton.next_power_of_2(geom.group), BLOCK_TOKENS=geom.block_tokens, MASS_CHUNK=_MASS_CHUNK,
    )
    return out, mass
