"""The first fused sketch kernel, kept only as bench_longctx/sketch_bench.py's baseline (6.6 ms per layer at 1M
on the H200): eviction/sketch_kernel.py replaced it. Its bound omits nothing the new one adds (exact fp32 dots).
Delete once the new kernel's H200 numbers are in the repo.

Per-block statistics from the 4-bit key sketch (eviction/sketch.py), fused: one pass over the codes.

For q head i, block b (kv head h = i // group) the kernel estimates every token's logit
from the sketch, l_t = scale * q_i . k_hat_t, and writes per (q head, block):
  lse    log sum_t exp(l_t) over the block's real tokens: the estimated softmax mass of
         the block up to the head's normalizer. Ranking blocks by it (normalized per head,
         mean over the GQA group) keeps what dense attention keeps: on real SmolLM2 Q/K it
         matched the oracle's mass where the max over tokens lost 2-7% (BENCHMARKS.md).
  upper  an upper bound on log sum_t exp(scale * q_i . k_t) over the TRUE keys:
         min(lse + err, log n_b + quest), err = scale * (half * sum_d |q_d| step_d + slack)
         the sketch's rounding bound, quest = scale * (q+ . max + q- . min) the min/max bound
         (both with a relative slack for fp32 rounding).
         eviction/certify.py turns it into a certified omitted mass.
planes=1 reads only the high plane of the codes (half the bytes, a 2-bit estimate with a
4x wider error bound): the coarse pass of a hierarchical selection. block_ids [H, C] restricts
the pass to C candidate blocks per kv head (the fine pass); without it every block is read.

Grid: one program per (block or candidate, kv head); it reads the block's two summary rows and
planes * block_tokens * head_dim / 4 code bytes, and the group's q rows from L2. The token estimates
are one fp32 dot per channel quarter (codes [tokens, D/4] x (q * step) [D/4, group], input_precision
"ieee": exact fp32, so the rounding slack still covers it); the first version looped over the group's
heads with a reduction per head and quarter and ran at 123 GB/s on the H200 (results/h200-sketch-default).

Layout: kernel -> launcher -> pure-torch reference. Imports only torch and triton.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from eviction.sketch_kernel import check_inputs

LEVELS = 15.0  # 4-bit codes 0..15 (eviction/sketch.py)
COARSE_MID, COARSE_HALF = 1.5, 2.0  # high plane alone: k_hat = min + step * (4 hi + 1.5), |k - k_hat| <= 2 step
FINE_HALF = 0.5  # both planes: |k - k_hat| <= step / 2
ROUNDING_SLACK = 1e-4  # relative slack on sum_d |q_d| max(|min_d|, |max_d|): fp32 arithmetic in the bounds
# The same constants as the compiled kernel sees them (a compiled kernel reads only constexpr globals;
# the interpreter reads any, so CPU tests cannot catch a plain float here)
_LEVELS, _COARSE_MID, _COARSE_HALF = tl.constexpr(LEVELS), tl.constexpr(COARSE_MID), tl.constexpr(COARSE_HALF)
_FINE_HALF, _ROUNDING_SLACK = tl.constexpr(FINE_HALF), tl.constexpr(ROUNDING_SLACK)


@triton.jit(do_not_specialize=["num_tokens", "num_cols"])
def _sketch_kernel(
    q_ptr,  # float16 [Hq, HEAD_DIM]
    s_ptr,  # float16 [num_blocks, 2, H, HEAD_DIM]
    c_ptr,  # uint8 [num_blocks, H, 2, BLOCK_TOKENS, HEAD_DIM // 4]
    ids_ptr,  # int64 [H, num_cols] (HAS_IDS) or unused
    lse_ptr,  # float32 [Hq, num_cols]
    upper_ptr,  # float32 [Hq, num_cols]
    num_tokens,
    num_cols,
    scale,
    stride_qh,
    stride_sn,
    stride_sm,
    stride_sh,
    stride_cn,
    stride_ch,
    stride_cp,
    stride_ct,
    stride_ih,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # >= max(GROUP, 16), a power of two: tl.dot's minimum
    HEAD_DIM: tl.constexpr,
    QUARTER: tl.constexpr,  # HEAD_DIM // 4, a power of two
    QUARTER_PAD: tl.constexpr,  # max(QUARTER, 16): tl.dot's minimum
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_T: tl.constexpr,  # next power of two >= max(BLOCK_TOKENS, 16)
    PLANES: tl.constexpr,
    HAS_IDS: tl.constexpr,
):
    col = tl.program_id(0)
    head = tl.program_id(1)
    if HAS_IDS:
        block = tl.load(ids_ptr + head * stride_ih + col)
    else:
        block = col.to(tl.int64)
    offs_t = tl.arange(0, BLOCK_T)
    offs_j = tl.arange(0, QUARTER_PAD)
    j_ok = offs_j < QUARTER
    offs_g = tl.arange(0, GROUP_PAD)
    g_ok = offs_g < GROUP
    valid_t = (offs_t < BLOCK_TOKENS) & (block * BLOCK_TOKENS + offs_t < num_tokens)
    n_real = tl.sum(valid_t.to(tl.float32), axis=0)
    s_row = s_ptr + block * stride_sn + head * stride_sh
    c_tile = c_ptr + block * stride_cn + head * stride_ch + offs_t[:, None] * stride_ct + offs_j[None, :]
    tile_ok = valid_t[:, None] & j_ok[None, :]
    hi = tl.load(c_tile, mask=tile_ok, other=0).to(tl.int32)  # [BLOCK_T, QUARTER_PAD]
    if PLANES == 2:
        lo = tl.load(c_tile + stride_cp, mask=tile_ok, other=0).to(tl.int32)
    q_rows = q_ptr + (head * GROUP + offs_g)[:, None] * stride_qh  # [GROUP_PAD, 1]: the group's q heads
    est = tl.zeros((BLOCK_T, GROUP_PAD), tl.float32)  # per token and q head: (q . (k_hat - min)) summed
    base = tl.zeros((GROUP_PAD,), tl.float32)  # q . min
    spread = tl.zeros((GROUP_PAD,), tl.float32)  # sum_d |q_d| step_d
    size = tl.zeros((GROUP_PAD,), tl.float32)  # sum_d |q_d| max(|min_d|, |max_d|)
    quest = tl.zeros((GROUP_PAD,), tl.float32)  # q+ . max + q- . min
    for i in tl.static_range(4):  # channel quarter i: bits 2i, 2i+1 of every code byte
        offs_d = i * QUARTER + offs_j
        q = tl.load(q_rows + offs_d[None, :], mask=g_ok[:, None] & j_ok[None, :], other=0.0).to(tl.float32)
        k_min = tl.load(s_row + offs_d, mask=j_ok, other=0.0).to(tl.float32)  # [QUARTER_PAD]; padding adds 0
        k_max = tl.load(s_row + stride_sm + offs_d, mask=j_ok, other=0.0).to(tl.float32)
        step = (k_max - k_min) / _LEVELS
        qs = q * step[None, :]  # [GROUP_PAD, QUARTER_PAD]
        code = ((hi >> (2 * i)) & 3).to(tl.float32) * 4.0
        if PLANES == 2:
            code += ((lo >> (2 * i)) & 3).to(tl.float32)
        else:
            code += _COARSE_MID
        est = tl.dot(code, tl.trans(qs), est, input_precision="ieee")  # [BLOCK_T, GROUP_PAD], exact fp32
        base += tl.sum(q * k_min[None, :], axis=1)
        spread += tl.sum(tl.abs(qs), axis=1)
        size += tl.sum(tl.abs(q) * tl.maximum(tl.abs(k_min), tl.abs(k_max))[None, :], axis=1)
        quest += tl.sum(tl.maximum(q * k_max[None, :], q * k_min[None, :]), axis=1)
    logit = tl.where(valid_t[:, None], (est + base[None, :]) * scale, float("-inf"))  # [BLOCK_T, GROUP_PAD]
    top = tl.max(logit, axis=0)  # [GROUP_PAD]
    lse = top + tl.log(tl.sum(tl.exp(logit - top[None, :]), axis=0))
    half = _FINE_HALF if PLANES == 2 else _COARSE_HALF
    err = (half * spread + _ROUNDING_SLACK * size) * scale
    upper = tl.minimum(lse + err, tl.log(n_real) + (quest + _ROUNDING_SLACK * size) * scale)
    out = (head * GROUP + offs_g) * stride_oh + col
    tl.store(lse_ptr + out, lse, mask=g_ok)
    tl.store(upper_ptr + out, upper, mask=g_ok)


def sketch_block_stats_v1(q: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor, num_tokens: int, *,
                       planes: int = 2, block_ids: torch.Tensor | None = None, scale: float | None = None,
                       num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse, upper) float32 [Hq, C]: per q head and block (C = num_blocks, or the columns of block_ids
    [H, C]) the log-sum-exp of the sketch's logit estimates and an upper bound on the true one.

    q: float16 [Hq, D]; summaries: float16 [N, 2, H, D]; codes: uint8 [>= N, H, 2, B, D // 4], each with a
    contiguous last dim; scale defaults to 1 / sqrt(D). Sync-free: capturable in a CUDA graph.
    num_warps is a tuning knob (bench_longctx/sketch_bench.py sweeps it).
    """
    num_blocks, num_kv_heads, block_tokens = check_inputs(q, summaries, codes, num_tokens, planes)
    head_dim = summaries.shape[3]
    if q.stride(1) != 1 or summaries.stride(3) != 1 or codes.stride(4) != 1:
        raise ValueError("q, summaries and codes need a contiguous last dim")
    if head_dim // 4 & (head_dim // 4 - 1):
        raise ValueError(f"head_dim / 4 must be a power of two, got head_dim {head_dim}")
    group = q.shape[0] // num_kv_heads
    if block_ids is not None and (block_ids.dim() != 2 or block_ids.shape[0] != num_kv_heads
                                  or block_ids.dtype != torch.int64 or block_ids.device != q.device):
        raise ValueError(f"block_ids: expected int64 [{num_kv_heads}, C] on {q.device}, got "
                         f"{block_ids.dtype} {list(block_ids.shape)} on {block_ids.device}")
    num_cols = num_blocks if block_ids is None else block_ids.shape[1]
    lse = torch.empty(q.shape[0], num_cols, dtype=torch.float32, device=q.device)  # [Hq, C]
    upper = torch.empty_like(lse)
    if num_cols == 0:
        return lse, upper
    ids = block_ids if block_ids is not None else lse  # unused pointer when HAS_IDS is off
    _sketch_kernel[(num_cols, num_kv_heads)](
        q, summaries, codes, ids, lse, upper, num_tokens, num_cols,
        1.0 / math.sqrt(head_dim) if scale is None else scale,
        q.stride(0), summaries.stride(0), summaries.stride(1), summaries.stride(2),
        codes.stride(0), codes.stride(1), codes.stride(2), codes.stride(3),
        ids.stride(0), lse.stride(0),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, QUARTER=head_dim // 4,
        QUARTER_PAD=max(16, head_dim // 4), BLOCK_TOKENS=block_tokens,
        BLOCK_T=max(16, triton.next_power_of_2(block_tokens)), PLANES=planes, HAS_IDS=block_ids is not None,
        num_warps=num_warps,
    )  # fmt: skip
    return lse, upper
