"""The previous first level of the sketch selector, kept only so bench_longctx/sketch_bench.py can time it against
eviction/sketch_channels.py on the same GPU run; delete once that comparison is recorded in BENCHMARKS.md.

Layout (the old one): codes uint8 [num_blocks, kv_heads, 2 (plane), block_tokens, head_dim // 4], token-major;
byte j of a plane row holds channels j, j + D/4, j + D/2, j + 3D/4 at bits 0-1, 2-3, 4-5, 6-7; plane 0 holds
code >> 2, plane 1 code & 3 (`pack_planes`). The kernel reads the high plane of every block (planes=1, the
coarse pass: 495 us at 1M tokens on the H200, results/h200-sketch-scan) or both planes (planes=2), one fp16
tl.dot per channel quarter, with the fp16 rounding of q * step folded into the certified error term.
`select_masked_planes` is the old SketchTopK.select_masked: coarse pass over every block, both planes of the
coarse_factor * k best, the k best by estimated mass (git history before the channel-major layout).

Layout: kernel -> launcher -> pure-torch reference. Imports only torch and triton.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LEVELS = 15.0  # 4-bit codes 0..15 (eviction/sketch.py)
COARSE_MID, COARSE_HALF = 1.5, 2.0  # high plane alone: k_hat = min + step * (4 hi + 1.5), |k - k_hat| <= 2 step
FINE_HALF = 0.5  # both planes: |k - k_hat| <= step / 2
ROUNDING_SLACK = 1e-4  # relative slack on sum_d |q_d| (|min_d| + |max_d|): fp32 arithmetic in the bounds
FP16_REL, FP16_TINY, FP16_MAX = 2.0**-11, 2.0**-25, 65504.0  # fp16 rounding: relative, subnormal, largest
# (tuning knobs) -> defaults per pass: the fastest of bench_longctx/sketch_bench.py's sweep at 1M tokens,
# 64-token blocks on the H200 (results/h200-sketch-scan/sketch_h200.json: coarse 495 us, fine 33 us)
DEFAULT_KNOBS = {1: dict(blocks_per_program=16, decode=1, num_warps=2, num_stages=3),
                 2: dict(blocks_per_program=1, decode=1, num_warps=2, num_stages=3)}
# The constants as the compiled kernel sees them (a compiled kernel reads only constexpr globals)
_LEVELS, _COARSE_MID, _COARSE_HALF = tl.constexpr(LEVELS), tl.constexpr(COARSE_MID), tl.constexpr(COARSE_HALF)
_FINE_HALF, _ROUNDING_SLACK = tl.constexpr(FINE_HALF), tl.constexpr(ROUNDING_SLACK)
_FP16_REL, _FP16_TINY, _FP16_MAX = tl.constexpr(FP16_REL), tl.constexpr(FP16_TINY), tl.constexpr(FP16_MAX)


def pack_planes(codes: torch.Tensor) -> torch.Tensor:
    """int codes [..., t, D] in [0, 15] -> uint8 [..., 2, t, D // 4]: high plane then low plane (the old layout)."""
    d = codes.shape[-1]
    quarters = codes.unflatten(-1, (4, d // 4))  # [..., t, 4, D/4]: quarter i = channels i*D/4 ..
    shifts = torch.arange(0, 8, 2, device=codes.device)[:, None]  # [4, 1]
    planes = [((quarters >> 2) << shifts).sum(-2), ((quarters & 3) << shifts).sum(-2)]
    return torch.stack(planes, dim=-3).to(torch.uint8)


@triton.jit
def _field(byte, SHIFT: tl.constexpr, DECODE: tl.constexpr):
    """uint8 code bytes -> the 2-bit field at bit SHIFT as float16 (0..3, exact)."""
    if DECODE == 1:  # 0x6400 is 1024.0: the field lands in the mantissa's low bits
        bits = ((byte.to(tl.int16) >> SHIFT) & 3) | 0x6400
        return bits.to(tl.float16, bitcast=True) - 1024.0
    else:
        return ((byte >> SHIFT) & 3).to(tl.float16)


@triton.jit(do_not_specialize=["num_tokens", "num_cols"])
def _sketch_kernel(
    q_ptr,  # float16 [Hq, HEAD_DIM]
    s_ptr,  # float16 [num_blocks, 2, H, HEAD_DIM]
    c_ptr,  # uint8 [num_blocks, H, 2, BLOCK_TOKENS, HEAD_DIM // 4]
    ids_ptr,  # int64 [H, num_cols] (HAS_IDS) or unused
    lse_ptr,  # float32 [Hq, num_cols]
    upper_ptr,  # float32 [Hq, num_cols]
    num_tokens, num_cols, scale,
    stride_qh, stride_sn, stride_sm, stride_sh, stride_cn, stride_ch, stride_cp, stride_ct, stride_ih, stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # power of two >= GROUP
    QUARTER: tl.constexpr,  # HEAD_DIM // 4, a power of two
    QUARTER_PAD: tl.constexpr,  # max(QUARTER, 16): tl.dot's smallest K
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_T: tl.constexpr,  # next power of two >= max(BLOCK_TOKENS, 16)
    PLANES: tl.constexpr,
    HAS_IDS: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
    DECODE: tl.constexpr,
):
    head = tl.program_id(1)
    offs_t = tl.arange(0, BLOCK_T)
    offs_j = tl.arange(0, QUARTER_PAD)
    j_ok = offs_j < QUARTER
    offs_g = tl.arange(0, GROUP_PAD)
    g_ok = offs_g < GROUP
    q_rows = q_ptr + (head * GROUP + offs_g)[:, None] * stride_qh + offs_j[None, :]  # [GROUP_PAD, QUARTER_PAD]
    q_ok = g_ok[:, None] & j_ok[None, :]
    q0 = tl.load(q_rows, mask=q_ok, other=0.0).to(tl.float32)  # the group's q, one tile per channel quarter
    q1 = tl.load(q_rows + QUARTER, mask=q_ok, other=0.0).to(tl.float32)
    q2 = tl.load(q_rows + 2 * QUARTER, mask=q_ok, other=0.0).to(tl.float32)
    q3 = tl.load(q_rows + 3 * QUARTER, mask=q_ok, other=0.0).to(tl.float32)
    CODE_SCALE: tl.constexpr = 1.0 if PLANES == 2 else 4.0  # the high plane's 4 rides on qs (exact)
    CODE_MAX: tl.constexpr = 15.0 if PLANES == 2 else 12.0  # the largest code . CODE_SCALE
    HALF: tl.constexpr = _FINE_HALF if PLANES == 2 else _COARSE_HALF
    MID: tl.constexpr = 0.0 if PLANES == 2 else _COARSE_MID
    for i in range(BLOCKS_PER_PROGRAM):
        col = tl.program_id(0) * BLOCKS_PER_PROGRAM + i
        if HAS_IDS:
            block = tl.load(ids_ptr + head * stride_ih + col, mask=col < num_cols, other=0)
        else:
            block = col.to(tl.int64)
        # (vector masks: the interpreter cannot AND a tensor with a scalar mask)
        valid_t = (offs_t < BLOCK_TOKENS) & (block * BLOCK_TOKENS + offs_t < num_tokens) & (offs_t * 0 + col < num_cols)
        s_ok = j_ok & (offs_j * 0 + col < num_cols)
        s_row = s_ptr + block * stride_sn + head * stride_sh + offs_j
        c_tile = c_ptr + block * stride_cn + head * stride_ch + offs_t[:, None] * stride_ct + offs_j[None, :]
        tile_ok = valid_t[:, None] & j_ok[None, :]
        hi = tl.load(c_tile, mask=tile_ok, other=0)  # uint8 [BLOCK_T, QUARTER_PAD]
        if PLANES == 2:
            lo = tl.load(c_tile + stride_cp, mask=tile_ok, other=0)
        est = tl.zeros((BLOCK_T, GROUP_PAD), tl.float32)  # per token and q head: code . fp16(CODE_SCALE qs)
        # per q head and channel of a quarter, summed over the quarters, then over channels once (fewer shuffles)
        base = tl.zeros((GROUP_PAD, QUARTER_PAD), tl.float32)  # q . min (+ MID sum_d qs_d)
        spread = tl.zeros((GROUP_PAD, QUARTER_PAD), tl.float32)  # S = sum_d |qs_d|
        size = tl.zeros((GROUP_PAD, QUARTER_PAD), tl.float32)  # |q| . (|min| + |max|)
        quest = tl.zeros((GROUP_PAD, QUARTER_PAD), tl.float32)  # q+ . max + q- . min
        big = tl.zeros((GROUP_PAD, QUARTER_PAD), tl.float32)  # max_d |CODE_SCALE qs_d|
        for quarter in tl.static_range(4):  # channel quarter: bits 2 quarter, 2 quarter + 1 of every code byte
            q = q0 if quarter == 0 else (q1 if quarter == 1 else (q2 if quarter == 2 else q3))
            k_min = tl.load(s_row + quarter * QUARTER, mask=s_ok, other=0.0).to(tl.float32)  # [QUARTER_PAD]
            k_max = tl.load(s_row + stride_sm + quarter * QUARTER, mask=s_ok, other=0.0).to(tl.float32)
            qs = q * ((k_max - k_min) / _LEVELS)[None, :]  # [GROUP_PAD, QUARTER_PAD]
            scaled = qs * CODE_SCALE
            big = tl.maximum(big, tl.abs(scaled))
            operand = tl.minimum(tl.maximum(scaled, -_FP16_MAX), _FP16_MAX).to(tl.float16)
            code = _field(hi, 2 * quarter, DECODE)
            if PLANES == 2:
                code = code * 4.0 + _field(lo, 2 * quarter, DECODE)  # 0..15, exact
            est = tl.dot(code, tl.trans(operand), est)  # [BLOCK_T, GROUP_PAD], fp16 in, fp32 accumulation
            base += q * k_min[None, :] + MID * qs
            spread += tl.abs(qs)
            size += tl.abs(q) * (tl.abs(k_min) + tl.abs(k_max))[None, :]
            quest += tl.maximum(q * k_max[None, :], q * k_min[None, :])
        base, spread, size, quest = tl.sum(base, 1), tl.sum(spread, 1), tl.sum(size, 1), tl.sum(quest, 1)
        logit = tl.where(valid_t[:, None], (est + base[None, :]) * scale, float("-inf"))  # [BLOCK_T, GROUP_PAD]
        top = tl.max(logit, axis=0)  # [GROUP_PAD]
        lse = top + tl.log(tl.sum(tl.exp(logit - top[None, :]), axis=0))
        fp16_err = CODE_MAX * (_FP16_REL * spread + 4 * QUARTER * _LEVELS * _FP16_TINY)
        err = (HALF * spread + fp16_err + _ROUNDING_SLACK * size) * scale
        n_real = tl.sum(valid_t.to(tl.float32), axis=0)
        quest_upper = tl.log(n_real) + (quest + _ROUNDING_SLACK * size) * scale
        upper = tl.where(tl.max(big, 1) < _FP16_MAX, tl.minimum(lse + err, quest_upper), quest_upper)
        out = (head * GROUP + offs_g) * stride_oh + col
        out_ok = g_ok & (offs_g * 0 + col < num_cols)
        tl.store(lse_ptr + out, lse, mask=out_ok)
        tl.store(upper_ptr + out, upper, mask=out_ok)


def check_inputs(q: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor, num_tokens: int,
                 planes: int) -> tuple[int, int, int]:
    """(num_blocks, kv_heads, block_tokens) or ValueError."""
    if summaries.dim() != 4 or summaries.shape[1] != 2 or summaries.dtype != torch.float16:
        raise ValueError(f"summaries: expected float16 [N, 2, H, D], got {summaries.dtype} {list(summaries.shape)}")
    num_blocks, _, num_kv_heads, head_dim = summaries.shape
    if codes.dtype != torch.uint8 or codes.dim() != 5 or codes.shape[0] < num_blocks \
            or tuple(codes.shape[1:3]) != (num_kv_heads, 2) or codes.shape[4] * 4 != head_dim:
        raise ValueError(f"codes: expected uint8 [{num_blocks}, {num_kv_heads}, 2, block_tokens, {head_dim // 4}], "
                         f"got {codes.dtype} {list(codes.shape)}")
    block_tokens = codes.shape[3]
    if q.dim() != 2 or q.shape[1] != head_dim or q.dtype != torch.float16 or q.shape[0] % num_kv_heads:
        raise ValueError(f"q: expected float16 [a multiple of {num_kv_heads}, {head_dim}], "
                         f"got {q.dtype} {list(q.shape)}")
    if not (num_blocks - 1) * block_tokens < num_tokens <= num_blocks * block_tokens:
        raise ValueError(f"num_tokens {num_tokens} does not fill {num_blocks} blocks of {block_tokens}")
    if planes not in (1, 2):
        raise ValueError(f"planes must be 1 (high plane) or 2 (both), got {planes}")
    if len({q.device, summaries.device, codes.device}) != 1:
        raise ValueError(f"q, summaries and codes must share a device, "
                         f"got {q.device}, {summaries.device}, {codes.device}")
    return num_blocks, num_kv_heads, block_tokens


def plane_block_stats(q: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor, num_tokens: int, *,
                       planes: int = 2, block_ids: torch.Tensor | None = None, scale: float | None = None,
                       **knobs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse, upper) float32 [Hq, C]: per q head and block (C = num_blocks, or the columns of block_ids
    [H, C]) the log-sum-exp of the sketch's logit estimates and an upper bound on the true one.

    q: float16 [Hq, D]; summaries: float16 [N, 2, H, D]; codes: uint8 [>= N, H, 2, B, D // 4], each with a
    contiguous last dim; D / 4 a power of two; scale defaults to 1 / sqrt(D). Sync-free: capturable
    in a CUDA graph. knobs (blocks_per_program, decode, num_warps, num_stages) override DEFAULT_KNOBS[planes].
    """
    num_blocks, num_kv_heads, block_tokens = check_inputs(q, summaries, codes, num_tokens, planes)
    head_dim = summaries.shape[3]
    if q.stride(1) != 1 or summaries.stride(3) != 1 or codes.stride(4) != 1:
        raise ValueError("q, summaries and codes need a contiguous last dim")
    if head_dim // 4 & (head_dim // 4 - 1):
        raise ValueError(f"head_dim / 4 must be a power of two, got head_dim {head_dim}")
    unknown = set(knobs) - set(DEFAULT_KNOBS[planes])
    if unknown:
        raise ValueError(f"unknown knobs {sorted(unknown)}; expected some of {sorted(DEFAULT_KNOBS[planes])}")
    knobs = {**DEFAULT_KNOBS[planes], **knobs}
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
    per_program = knobs["blocks_per_program"]
    _sketch_kernel[(triton.cdiv(num_cols, per_program), num_kv_heads)](
        q, summaries, codes, ids, lse, upper, num_tokens, num_cols,
        1.0 / math.sqrt(head_dim) if scale is None else scale,
        q.stride(0), summaries.stride(0), summaries.stride(1), summaries.stride(2),
        codes.stride(0), codes.stride(1), codes.stride(2), codes.stride(3), ids.stride(0), lse.stride(0),
        GROUP=group, GROUP_PAD=max(8, triton.next_power_of_2(group)), QUARTER=head_dim // 4,
        QUARTER_PAD=max(16, head_dim // 4), BLOCK_TOKENS=block_tokens,
        BLOCK_T=max(16, triton.next_power_of_2(block_tokens)), PLANES=planes,
        HAS_IDS=block_ids is not None, BLOCKS_PER_PROGRAM=per_program, DECODE=knobs["decode"],
        num_warps=knobs["num_warps"], num_stages=knobs["num_stages"],
    )  # fmt: skip
    return lse, upper


def plane_block_stats_ref(q: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor, num_tokens: int, *,
                           planes: int = 2, block_ids: torch.Tensor | None = None,
                           scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of `plane_block_stats` (same contract and the same fp16 rounding of q * step);
    also the CPU path."""
    num_blocks, num_kv_heads, block_tokens = check_inputs(q, summaries, codes, num_tokens, planes)
    head_dim = summaries.shape[3]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = q.shape[0] // num_kv_heads
    if block_ids is None:
        block_ids = torch.arange(num_blocks, device=q.device).expand(num_kv_heads, num_blocks)
    s = summaries.float()[block_ids, :, torch.arange(num_kv_heads, device=q.device)[:, None]]  # [H, C, 2, D]
    low, high = s[:, :, 0], s[:, :, 1]
    step = (high - low) / LEVELS
    c = codes[block_ids, torch.arange(num_kv_heads, device=q.device)[:, None]].to(torch.int64)  # [H, C, 2, B, D/4]
    shifts = torch.arange(0, 8, 2, device=q.device)[:, None]
    quarters = (c.unsqueeze(-2) >> shifts) & 3  # [H, C, 2, B, 4, D/4]
    code_scale, code_max = (1.0, 15.0) if planes == 2 else (4.0, 12.0)
    code = (quarters[:, :, 0] * 4 + quarters[:, :, 1] if planes == 2 else quarters[:, :, 0]).flatten(-2).float()
    qg = q.float().view(num_kv_heads, group, head_dim)  # [H, G, D]
    qs = qg[:, :, None] * step[:, None]  # [H, G, C, D]
    operand = (qs * code_scale).clamp(-FP16_MAX, FP16_MAX).half().float()  # what the tensor cores multiply
    mid = 0.0 if planes == 2 else COARSE_MID
    base = torch.einsum("hgd,hcd->hgc", qg, low) + mid * qs.sum(-1)  # [H, G, C]
    logit = (base[..., None] + torch.einsum("hgcd,hcbd->hgcb", operand, code)) * scale
    real = block_ids[:, :, None] * block_tokens + torch.arange(block_tokens, device=q.device) < num_tokens  # [H,C,B]
    lse = torch.logsumexp(logit.masked_fill(~real[:, None], float("-inf")), dim=-1)  # [H, G, C]
    half = FINE_HALF if planes == 2 else COARSE_HALF
    spread = qs.abs().sum(-1)
    size = torch.einsum("hgd,hcd->hgc", qg.abs(), low.abs() + high.abs())
    fp16_err = code_max * (FP16_REL * spread + head_dim * LEVELS * FP16_TINY)
    err = (half * spread + fp16_err + ROUNDING_SLACK * size) * scale
    quest = torch.einsum("hgd,hcd->hgc", qg.clamp(min=0), high) + torch.einsum("hgd,hcd->hgc", qg.clamp(max=0), low)
    quest_upper = real.sum(-1).float().log()[:, None] + (quest + ROUNDING_SLACK * size) * scale
    fits = (qs * code_scale).abs().amax(-1) < FP16_MAX
    upper = torch.where(fits, torch.minimum(lse + err, quest_upper), quest_upper)
    return lse.flatten(0, 1), upper.flatten(0, 1)


def select_masked_planes(q: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor, valid: torch.Tensor,
                         protected: torch.Tensor, k: int, coarse_factor: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The old SketchTopK.select_masked over old-layout codes: (selected int64 [H, k] ascending, upper [Hq, N])."""
    from eviction.select import top_blocks  # the benchmark's comparison only; kernels above import torch and triton

    stats = plane_block_stats if q.is_cuda else plane_block_stats_ref
    n, h = summaries.shape[0], summaries.shape[2]
    num_tokens, group = n * codes.shape[3], q.shape[0] // h
    two_pass = bool(coarse_factor) and coarse_factor * k < n
    lse, upper = stats(q, summaries, codes, num_tokens, planes=1 if two_pass else 2)
    upper = upper.masked_fill(~valid, float("-inf"))
    drop, keep = ~valid, protected & valid
    skip = drop | (valid & ~torch.cat((valid[1:], valid.new_zeros(1))))  # and the last real block (the tail)

    def ranked(x: torch.Tensor) -> torch.Tensor:
        share = torch.softmax(x.masked_fill(skip, float("-inf")), dim=1).view(h, group, n).mean(1)
        return share.nan_to_num(nan=float("-inf")).masked_fill(drop, float("-inf")).masked_fill(keep, float("inf"))

    scores = ranked(lse)
    if two_pass:
        candidates = top_blocks(scores, coarse_factor * k)  # [H, C]
        rows = candidates.repeat_interleave(group, dim=0)  # [Hq, C]
        fine_lse, fine_upper = stats(q, summaries, codes, num_tokens, planes=2, block_ids=candidates)
        upper = upper.scatter(1, rows, torch.minimum(fine_upper, upper.gather(1, rows)))
        fine_scores = ranked(lse.scatter(1, rows, fine_lse)).gather(1, candidates)
        scores = torch.full_like(scores, float("-inf")).scatter(1, candidates, fine_scores)
    return top_blocks(scores, k), upper
