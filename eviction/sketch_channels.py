"""The sketch selector's first level: a few channels of every block's 4-bit codes, the rest bounded by min/max.

SparQ (Ribar et al. 2023) estimates logits from the r channels of largest |q|. Here a small launch picks, per kv
head, the r channels of largest |q_d| summed over the GQA group (eviction/sketch_plan.py), and the scan reads, per
block, the summaries (every channel's min and max) and the codes of those r channels only: r rows of B/2 bytes in
the channel-major layout (eviction/sketch.py), r / D of the codes. (Weighting |q_d| by the channel's typical step,
max - min, ranks norm-matched needles among 256K-1M synthetic keys worse, e.g. 237th instead of 7th of 4K blocks
at r = 32 of 128, and keeps real SmolLM2 blocks no better: BENCHMARKS.md, Selection quality.)
Per q head i and block b, with R the read channels and U the others, c = (min + max) / 2, w = (max - min) / 2:
  partial_t = q_R . k_hat_R,t   (4-bit estimate over R, |error| <= err_R = S_R / 2 + fp16 rounding,
                                 S_R = sum_R |q_j| step_j)
  lse    log sum_t exp(scale (partial_t + q_U . c_U)): the block's estimated mass, the unread channels at
         the box's centre (the ranking; eviction/sketch_topk.py refines the best coarse_factor x k blocks)
  upper  min(log sum_t exp(scale partial_t) + scale (q_U . c_U + |q_U| . w_U + err_R + slack),
             log n_b + scale (Quest over every channel + slack)) + 1e-5:
         q_U . k_U <= q_U . c_U + |q_U| . w_U for every key in the box (Quest's bound on the unread channels),
         so upper bounds log sum_t exp(scale q . k_t) over the TRUE keys. slack = ROUNDING_SLACK |q| . (|min| +
         |max|) covers fp32 accumulation, 1e-5 the approximate exp2 / log2; err_R's fp16 term is the rounding
         of q_j step_j, as in eviction/sketch_kernel.py, whose reasoning applies unchanged.
Every per-block sum over channels (Quest on U and on R, q_R . min_R, S_R, size) is a tensor-core dot of the fp16
summaries against fp16 columns of q masked to U or R (exact products, fp32 sums); the read channels' estimate is
one batched dot per nibble, codes [B/2, r] x fp16(q_R step) [r, G] per block. A block whose size / 15 reaches
fp16's range (never for real keys) keeps Quest's bound alone. Garbage in blocks outside `valid` stays there:
their lse and upper are -inf.
The form keeps the instruction count down (sm_90 SASS, triton 3.6): per-block sums by dots instead of cross-lane
reductions (792 against 982 warp-instructions per block and kv head at r = 16), no token masks when every block is
full (982 against 1128); a channel-at-a-time FMA loop issues 3x as many.

On CUDA, `channel_block_stats` runs the scan as eviction/sketch_mma.cu where it can (the same numbers from a kernel
that decodes the codes into tensor-core operands in registers: 170 against 350 us at 1M); the Triton kernel below
serves the rest and any call that passes knobs. The plan may read channels in adjacent pairs (pairs=True): 64-byte
code rows, 148 us, one needle of 241 lost at r = 64. Both: bench_longctx.sketch_bench; BENCHMARKS.md, Sketch selector.

Layout: kernels -> launcher -> pure-torch reference. Imports only torch and triton (and the nibble decoder and
constants of eviction/sketch_kernel.py, the channel plan of eviction/sketch_plan.py, the CUDA kernel's launcher).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from eviction import sketch_mma
from eviction.sketch_kernel import (ABSOLUTE_SLACK, FP16_MAX, FP16_REL, FP16_TINY, HALF_STEP, LEVELS, ROUNDING_SLACK,
                                    _ABSOLUTE_SLACK, _FP16_MAX, _FP16_REL, _FP16_TINY, _HALF_STEP, _LEVELS,
                                    _ROUNDING_SLACK, check_inputs, check_kernel_layout, nibble)
from eviction.sketch_plan import read_channels, read_channels_ref


# fastest tile shape at 1M on the H200 for r = 16, 32 and 64 (194 / 244 / 353 us), although 16 x 4 spills registers
# at r = 32: bench_longctx.sketch_bench; BENCHMARKS.md, Sketch selector
DEFAULT_KNOBS = dict(blocks_per_program=16, decode=1, num_warps=4, num_stages=1)


@triton.jit(do_not_specialize=["num_tokens", "num_blocks"])
def _channel_kernel(
    q_ptr,  # float16 [Hq, HEAD_DIM]
    s_ptr,  # float16 [num_blocks, 2, H, HEAD_DIM]
    c_ptr,  # uint8 [num_blocks, H, HEAD_DIM, BLOCK_TOKENS // 2] (channel rows)
    ch_ptr,  # int32 [H, CHANNELS]: the channels to read (eviction/sketch_plan.py)
    valid_ptr,  # bool [num_blocks] (HAS_VALID) or unused
    lse_ptr, upper_ptr,  # float32 [Hq, num_blocks]
    num_tokens, num_blocks, scale,
    stride_qh, stride_sn, stride_sm, stride_sh, stride_cn, stride_ch, stride_chh, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, CHANNELS: tl.constexpr,
    CHANNELS_PAD: tl.constexpr,  # CHANNELS rounded up to a power of two: the padding reads nothing, q_j = 0 there
    BLOCK_TOKENS: tl.constexpr, HALF_PAD: tl.constexpr, BLOCKS: tl.constexpr, HAS_VALID: tl.constexpr,
    FULL: tl.constexpr,  # every token of every block is real (num_tokens = num_blocks * BLOCK_TOKENS, a power of 2)
    DECODE: tl.constexpr,
):
    head = tl.program_id(1)
    offs_b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, HALF_PAD)
    g_ok = offs_g < GROUP
    live = offs_b < num_blocks
    if HAS_VALID:
        live = live & (tl.load(valid_ptr + offs_b, mask=live, other=0) != 0)
    blocks = offs_b.to(tl.int64)
    q_row = q_ptr + (head * GROUP + offs_g) * stride_qh  # [GROUP_PAD]
    q_t = tl.load(q_row[None, :] + offs_d[:, None], mask=g_ok[None, :], other=0.0)  # fp16 [HEAD_DIM, GROUP_PAD]
    ch_ok = tl.arange(0, CHANNELS_PAD) < CHANNELS
    ch = tl.load(ch_ptr + head * stride_chh + tl.arange(0, CHANNELS_PAD), mask=ch_ok, other=0)  # int32 [CHANNELS_PAD]
    read = tl.max(((offs_d[:, None] == ch[None, :]) & ch_ok[None, :]).to(tl.int32), 1) > 0  # [HEAD_DIM]
    zero = tl.zeros_like(q_t)
    q_u = tl.where(read[:, None], zero, q_t)  # fp16 [HEAD_DIM, GROUP_PAD]: the unread channels' q, the read ones'
    q_r = tl.where(read[:, None], q_t, zero)
    u_pos, u_neg = tl.maximum(q_u, zero), tl.minimum(q_u, zero)  # (all exact in fp16)
    r_pos, r_neg = tl.maximum(q_r, zero), tl.minimum(q_r, zero)
    # every per-block sum over channels is a tensor-core dot of the fp16 summaries against a q column set: exact
    # fp16 products summed in fp32 (errors inside slack * size)
    s_rows = s_ptr + blocks[:, None] * stride_sn + head * stride_sh + offs_d[None, :]
    k_min = tl.load(s_rows, mask=live[:, None], other=0.0)  # fp16 [BLOCKS, HEAD_DIM]
    k_max = tl.load(s_rows + stride_sm, mask=live[:, None], other=0.0)
    top_u = tl.dot(k_max, u_pos) + tl.dot(k_min, u_neg)  # [BLOCKS, GROUP_PAD]: max of q_U . k_U over the box
    bottom_u = tl.dot(k_max, u_neg) + tl.dot(k_min, u_pos)  # its min
    quest_r = tl.dot(k_max, r_pos) + tl.dot(k_min, r_neg)  # Quest on the read channels
    base = tl.dot(k_min, q_r)  # q_R . min_R
    spread = (tl.dot(k_max, r_pos - r_neg) - tl.dot(k_min, r_pos - r_neg)) / _LEVELS  # S_R = sum_R |q_j| step_j
    q_abs = tl.abs(q_t)
    size = tl.dot(tl.abs(k_min), q_abs) + tl.dot(tl.abs(k_max), q_abs)  # |q| . (|min| + |max|)
    slack = _ROUNDING_SLACK * size
    # the read channels' codes against fp16(q_j step_j); size / 15 bounds every |q_j step_j| (fp16 overflow check)
    q_j = tl.load(q_row[:, None] + ch[None, :], mask=g_ok[:, None] & ch_ok[None, :], other=0.0).to(tl.float32)
    r_rows = s_ptr + blocks[:, None] * stride_sn + head * stride_sh + ch[None, :]
    r_min = tl.load(r_rows, mask=live[:, None], other=0.0).to(tl.float32)  # [BLOCKS, CHANNELS_PAD]
    r_max = tl.load(r_rows + stride_sm, mask=live[:, None], other=0.0).to(tl.float32)
    qs = q_j[None, :, :] * ((r_max - r_min) / _LEVELS)[:, None, :]  # [BLOCKS, GROUP_PAD, CHANNELS_PAD]
    operand = tl.minimum(tl.maximum(qs, -_FP16_MAX), _FP16_MAX).to(tl.float16)
    fits = size < _LEVELS * _FP16_MAX
    codes = (c_ptr + blocks[:, None, None] * stride_cn + head * stride_ch
             + ch[None, :, None] * (BLOCK_TOKENS // 2) + offs_t[None, None, :])
    byte = tl.load(codes, mask=live[:, None, None] & (offs_t < BLOCK_TOKENS // 2)[None, None, :], other=0)
    operand_t = tl.permute(operand, (0, 2, 1))  # [BLOCKS, CHANNELS_PAD, GROUP_PAD]
    est_lo = tl.dot(tl.permute(nibble(byte, 0, DECODE), (0, 2, 1)), operand_t)  # [BLOCKS, HALF_PAD, GROUP_PAD]
    est_hi = tl.dot(tl.permute(nibble(byte, 1, DECODE), (0, 2, 1)), operand_t)  # tokens 2t (lo), 2t + 1 (hi)
    log2_scale = scale * 1.4426950408889634  # logits in base 2: exp2 needs no extra multiply
    logit_lo = (est_lo + base[:, None, :]) * log2_scale  # [BLOCKS, HALF_PAD, GROUP_PAD]
    logit_hi = (est_hi + base[:, None, :]) * log2_scale
    if not FULL:  # a partial tail block (or a block size below a power of two): mask the missing tokens
        first = offs_b[:, None] * BLOCK_TOKENS + 2 * offs_t[None, :]  # [BLOCKS, HALF_PAD]
        ok_lo = (2 * offs_t < BLOCK_TOKENS)[None, :] & (first < num_tokens)
        ok_hi = (2 * offs_t + 1 < BLOCK_TOKENS)[None, :] & (first + 1 < num_tokens)
        logit_lo = tl.where(ok_lo[:, :, None], logit_lo, float("-inf"))
        logit_hi = tl.where(ok_hi[:, :, None], logit_hi, float("-inf"))
        n_real = tl.sum(ok_lo.to(tl.float32), 1) + tl.sum(ok_hi.to(tl.float32), 1)  # [BLOCKS]
    else:
        n_real = tl.full((BLOCKS,), BLOCK_TOKENS, tl.float32)
    top = tl.maximum(tl.max(logit_lo, 1), tl.max(logit_hi, 1))  # [BLOCKS, GROUP_PAD]
    top = tl.where(top == float("-inf"), 0.0, top)  # a block past the end: no NaN from -inf - -inf
    total = tl.sum(tl.exp2(logit_lo - top[:, None, :]), 1) + tl.sum(tl.exp2(logit_hi - top[:, None, :]), 1)
    partial = (top + tl.log2(total)) * 0.6931471805599453  # log sum_t exp(scale partial_t)
    err = _HALF_STEP * spread + _LEVELS * (_FP16_REL * spread + CHANNELS * _LEVELS * _FP16_TINY)
    quest_upper = tl.log(n_real)[:, None] + (top_u + quest_r + slack) * scale
    upper = tl.where(fits, tl.minimum(partial + (top_u + err + slack) * scale, quest_upper), quest_upper)
    upper += _ABSOLUTE_SLACK
    lse = partial + 0.5 * (top_u + bottom_u) * scale
    out = (head * GROUP + offs_g)[None, :] * stride_oh + offs_b[:, None]  # [BLOCKS, GROUP_PAD]
    out_ok = (offs_b < num_blocks)[:, None] & g_ok[None, :]
    tl.store(lse_ptr + out, tl.where(live[:, None], lse, float("-inf")), mask=out_ok)
    tl.store(upper_ptr + out, tl.where(live[:, None], upper, float("-inf")), mask=out_ok)


def channel_block_stats(q: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor, num_tokens: int,
                        num_channels: int, valid: torch.Tensor | None = None, *, scale: float | None = None,
                        pairs: bool = False, **knobs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse, upper) float32 [Hq, N] from num_channels channels of every block's codes and every block's summaries
    (module docstring); -inf outside valid (bool [N]). q float16 [Hq, D], summaries float16 [N, 2, H, D], codes
    uint8 [>= N, H, 2, B, D // 4]; D a power of two >= 16, num_channels a multiple of 16, B even. Sync-free.
    pairs: the channels are read in adjacent pairs (2p, 2p + 1) (eviction/sketch_plan.py). The CUDA kernel
    (eviction/sketch_mma.py) serves where it can; knobs (blocks_per_program, decode, num_warps, num_stages)
    override DEFAULT_KNOBS and ask for the Triton kernel."""
    num_blocks, num_kv_heads, block_tokens = check_inputs(q, summaries, codes, num_tokens)
    check_kernel_layout(q, summaries, codes, block_tokens)
    _check_channels(num_channels, summaries.shape[3], valid, num_blocks, pairs)
    if num_channels % 16:
        raise ValueError(f"the kernels read a multiple of 16 channels, got {num_channels}")
    unknown = set(knobs) - set(DEFAULT_KNOBS)
    if unknown:
        raise ValueError(f"unknown knobs {sorted(unknown)}; expected some of {sorted(DEFAULT_KNOBS)}")
    given, knobs = bool(knobs), {**DEFAULT_KNOBS, **knobs}
    per_program = knobs["blocks_per_program"]
    if per_program < 1 or per_program & (per_program - 1):
        raise ValueError(f"blocks_per_program must be a power of two, got {per_program}")
    lse = torch.empty(q.shape[0], num_blocks, dtype=torch.float32, device=q.device)  # [Hq, N]
    upper = torch.empty_like(lse)
    group, head_dim = q.shape[0] // num_kv_heads, summaries.shape[3]
    # GROUP_PAD >= 2 below: with one q head per kv head (a dot's N = 1) triton 3.6 miscompiles the channel kernel on
    # sm_90 for BLOCKS > 1 (wrong bounds for some blocks on the H200, depending on num_warps); a padded second
    # column is masked out and costs nothing measurable at these sizes
    channels = read_channels(q, num_kv_heads, num_channels, pairs)  # int32 [H, r]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if not given and sketch_mma.usable(q, summaries, codes, num_channels):  # explicit knobs ask for Triton's
        sketch_mma.launch(q, summaries, codes, channels, valid, lse, upper, num_tokens, scale)
        return lse, upper
    _channel_kernel[(triton.cdiv(num_blocks, per_program), num_kv_heads)](
        q, summaries, codes, channels, lse if valid is None else valid, lse, upper, num_tokens, num_blocks, scale,
        q.stride(0), summaries.stride(0), summaries.stride(1), summaries.stride(2), codes.stride(0), codes.stride(1),
        channels.stride(0), lse.stride(0),
        GROUP=group, GROUP_PAD=max(triton.next_power_of_2(group), 2), HEAD_DIM=head_dim, CHANNELS=num_channels,
        CHANNELS_PAD=triton.next_power_of_2(num_channels), BLOCK_TOKENS=block_tokens,
        HALF_PAD=triton.next_power_of_2(block_tokens // 2), BLOCKS=per_program,
        HAS_VALID=valid is not None, DECODE=knobs["decode"], num_warps=knobs["num_warps"],
        FULL=num_tokens == num_blocks * block_tokens and block_tokens & (block_tokens - 1) == 0,
        num_stages=knobs["num_stages"],
    )  # fmt: skip
    return lse, upper


def _check_channels(num_channels: int, head_dim: int, valid: torch.Tensor | None, num_blocks: int,
                    pairs: bool = False) -> None:
    if isinstance(num_channels, bool) or not isinstance(num_channels, int) or not 0 < num_channels <= head_dim:
        raise ValueError(f"num_channels must be an int in [1, {head_dim}], got {num_channels!r}")
    if pairs and num_channels % 2:
        raise ValueError(f"channels read in pairs need an even num_channels, got {num_channels}")
    if valid is not None and (valid.shape != (num_blocks,) or valid.dtype != torch.bool):
        raise ValueError(f"valid: expected bool [{num_blocks}], got {valid.dtype} {list(valid.shape)}")


def channel_block_stats_ref(q: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor, num_tokens: int,
                            num_channels: int, valid: torch.Tensor | None = None, *, scale: float | None = None,
                            pairs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of `channel_block_stats` (the same fp16 rounding of q_R * step); also the CPU path.
    Any block size and channel count."""
    num_blocks, num_kv_heads, block_tokens = check_inputs(q, summaries, codes, num_tokens)
    head_dim = summaries.shape[3]
    _check_channels(num_channels, head_dim, valid, num_blocks, pairs)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    qg = q.float().view(num_kv_heads, -1, head_dim)  # [H, G, D]
    s = summaries.float().transpose(0, 2)  # [H, 2, N, D]
    low, high = s[:, 0], s[:, 1]  # [H, N, D]
    idx = read_channels_ref(q, num_kv_heads, num_channels, pairs)  # [H, r]
    read = torch.zeros(num_kv_heads, head_dim, dtype=torch.bool, device=q.device).scatter_(1, idx, True)
    q_u = qg.masked_fill(read[:, None], 0.0)
    u_pos, u_neg = q_u.clamp(min=0), q_u.clamp(max=0)
    top_u = torch.einsum("hgd,hnd->hgn", u_pos, high) + torch.einsum("hgd,hnd->hgn", u_neg, low)
    bottom_u = torch.einsum("hgd,hnd->hgn", u_neg, high) + torch.einsum("hgd,hnd->hgn", u_pos, low)
    size = torch.einsum("hgd,hnd->hgn", qg.abs(), low.abs() + high.abs())
    slack = ROUNDING_SLACK * size  # [H, G, N]
    q_r = torch.gather(qg, 2, idx[:, None].expand(-1, qg.shape[1], -1))  # [H, G, r]
    r_low, r_high = (torch.gather(x, 2, idx[:, None].expand(-1, num_blocks, -1)) for x in (low, high))  # [H, N, r]
    qs = q_r[:, :, None] * ((r_high - r_low) / LEVELS)[:, None]  # [H, G, N, r]
    operand = qs.clamp(-FP16_MAX, FP16_MAX).half().float()
    nib = idx[:, :, None] * block_tokens + torch.arange(block_tokens, device=q.device)  # [H, r, B]: nibble index
    flat = codes[:num_blocks].flatten(2).to(torch.int64)  # [N, H, B * D / 2]
    byte = torch.gather(flat, 2, (nib // 2).flatten(1)[None].expand(num_blocks, -1, -1))  # [N, H, r * B]
    code = ((byte >> (4 * (nib % 2)).flatten(1)[None]) & 15).view(num_blocks, num_kv_heads, -1, block_tokens)
    code = code.permute(1, 0, 3, 2).float()  # [H, N, B, r]
    partial = (torch.einsum("hgr,hnr->hgn", q_r, r_low)[..., None] + torch.einsum("hgnr,hnbr->hgnb", operand, code))
    real = torch.arange(num_blocks * block_tokens, device=q.device).view(num_blocks, block_tokens) < num_tokens
    partial = torch.logsumexp((partial * scale).masked_fill(~real, float("-inf")), dim=-1)  # [H, G, N]
    spread = qs.abs().sum(-1)
    err = HALF_STEP * spread + LEVELS * (FP16_REL * spread + idx.shape[1] * LEVELS * FP16_TINY)
    quest_r = torch.maximum(q_r[:, :, None] * r_high[:, None], q_r[:, :, None] * r_low[:, None]).sum(-1)
    quest_upper = real.sum(-1).float().log() + (top_u + quest_r + slack) * scale
    upper = torch.minimum(partial + (top_u + err + slack) * scale, quest_upper)
    upper = torch.where(size < LEVELS * FP16_MAX, upper, quest_upper) + ABSOLUTE_SLACK
    lse = partial + 0.5 * (top_u + bottom_u) * scale
    if valid is not None:
        lse, upper = lse.masked_fill(~valid, float("-inf")), upper.masked_fill(~valid, float("-inf"))
    return lse.flatten(0, 1), upper.flatten(0, 1)
