"""Per-block statistics from every channel of the 4-bit key sketch (eviction/sketch.py), fused: one pass over the codes.

For q head i, block b (kv head h = i // group) the kernel estimates every token's logit
from the sketch, l_t = scale * q_i . k_hat_t, and computes per (q head, block):
  lse    log sum_t exp(l_t) over the block's real tokens: the estimated softmax mass of
         the block up to the head's normalizer.
  upper  an upper bound on log sum_t exp(scale * q_i . k_t) over the TRUE keys:
         min(lse + err, log n_b + quest), quest = scale * (q+ . max + q- . min) Quest's min/max
         bound, err = scale * (S / 2 + 15 (2^-11 S + D 15 2^-25) + slack * size),
         S = sum_d |q_d| step_d, size = |q| . (|min| + |max|). eviction/certify.py turns it into
         a certified omitted mass.
This is the fine pass of the sketch selector (block_ids [H, C]: C candidate blocks per kv head, from
eviction/sketch_channels.py's cheaper first level) and its full scan (every block). `refine_candidates`
runs the same pass for the captured selection and finishes the candidates' work in the same launch:
their ranking score (the group mean of exp(lse - z), z the head's normalizer from the first level) and
the min of their fine upper bound into the first level's bound.

Why the bound holds with fp16 tensor cores. The estimate is sum_d code_d * qs_d, qs_d = q_d step_d,
computed as fp16 tl.dots, codes (integers <= 15, exact in fp16) against fp16(qs), fp32 accumulation.
fp16 round-to-nearest gives |x - fp16(x)| <= 2^-11 |x| + 2^-25 (the second term for subnormals) when
|x| < 65504, so the dot differs from the exact sum by at most 15 (2^-11 S + D 15 2^-25); fp16
products are exact in fp32, and fp32 accumulation, step's division and the other sums stay far inside
slack * size (ROUNDING_SLACK = 1e-4 >> D 2^-23). A block whose |qs| reaches 65504 in any channel (never
for real keys) gets err = inf: its upper is Quest's bound alone. The torch reference rounds qs the same way,
so kernel and reference agree to fp32 accumulation order.

Codes are channel-major (channel_rows: [D, B/2] bytes per block and kv head, byte j = tokens 2j, 2j+1):
a program loads a block's rows once and runs one dot per nibble, [G, D] x [D, B/2]. DECODE picks how a
nibble becomes fp16: 0 converts the integer, 1 ORs it into the mantissa of 1024.0 and subtracts (no
int->float conversion unit). Knobs (blocks per program, DECODE, num_warps, num_stages) are swept by
bench_longctx/sketch_bench.py.

Layout: kernel -> launchers -> pure-torch reference. Imports only torch and triton.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LEVELS = 15.0  # 4-bit codes 0..15 (eviction/sketch.py)
HALF_STEP = 0.5  # |k - k_hat| <= step / 2
ROUNDING_SLACK = 1e-4  # relative slack on sum_d |q_d| (|min_d| + |max_d|): fp32 arithmetic in the bounds
ABSOLUTE_SLACK = 1e-5  # nats: exp / log run on approximate units (relative error ~2^-22); covers size ~ 0 too
FP16_REL, FP16_TINY, FP16_MAX = 2.0**-11, 2.0**-25, 65504.0  # fp16 rounding: relative, subnormal, largest
DEFAULT_KNOBS = dict(blocks_per_program=1, decode=1, num_warps=2, num_stages=3)  # sketch_block_stats' (H200)
# refine_candidates' own: fastest for 256 candidates x 8 kv heads of 64-token blocks at d128 in a graph on the H200
# (17.2 us against DEFAULT_KNOBS' 21.5): bench_longctx.sketch_bench, stages; BENCHMARKS.md, Sketch selector
REFINE_KNOBS = dict(DEFAULT_KNOBS, blocks_per_program=2, num_warps=1, num_stages=2)
# The constants as the compiled kernel sees them (a compiled kernel reads only constexpr globals)
_LEVELS, _HALF_STEP, _ROUNDING_SLACK = tl.constexpr(LEVELS), tl.constexpr(HALF_STEP), tl.constexpr(ROUNDING_SLACK)
_FP16_REL, _FP16_TINY, _FP16_MAX = tl.constexpr(FP16_REL), tl.constexpr(FP16_TINY), tl.constexpr(FP16_MAX)
_ABSOLUTE_SLACK = tl.constexpr(ABSOLUTE_SLACK)


@triton.jit
def nibble(byte, HIGH: tl.constexpr, DECODE: tl.constexpr):
    """uint8 code bytes -> the low (HIGH=0) or high nibble as float16 (0..15, exact)."""
    if DECODE == 1:  # 0x6400 is 1024.0: the nibble lands in the mantissa's low bits
        bits = ((byte.to(tl.int16) >> (4 * HIGH)) & 15) | 0x6400
        return bits.to(tl.float16, bitcast=True) - 1024.0
    else:
        return ((byte >> (4 * HIGH)) & 15).to(tl.float16)


@triton.jit(do_not_specialize=["num_tokens", "num_cols", "num_blocks"])
def _fine_kernel(
    q_ptr,  # float16 [Hq, HEAD_DIM]
    s_ptr,  # float16 [num_blocks, 2, H, HEAD_DIM]
    c_ptr,  # uint8 [num_blocks, H, HEAD_DIM, BLOCK_TOKENS // 2] (channel rows)
    ids_ptr,  # int64 [H, num_cols] (HAS_IDS) or unused
    lse_ptr,  # float32 [Hq, num_cols] (plain) | scores float32 [H, num_cols] (MERGE)
    upper_ptr,  # float32 [Hq, num_cols] (plain) | [Hq, num_blocks], min'ed in place (MERGE)
    z_ptr, keep_ptr, valid_ptr,  # MERGE: float32 [Hq] normalizers, bool [num_blocks] kept and live blocks
    num_tokens, num_cols, num_blocks, scale,
    stride_qh, stride_sn, stride_sm, stride_sh, stride_cn, stride_ch, stride_ih, stride_oh, stride_uh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr, HALF_PAD: tl.constexpr,  # next power of two >= BLOCK_TOKENS // 2
    HAS_IDS: tl.constexpr, MERGE: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr, DECODE: tl.constexpr,
):
    head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_t = tl.arange(0, HALF_PAD)
    g_ok = offs_g < GROUP
    q = tl.load(q_ptr + (head * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :], mask=g_ok[:, None],
                other=0.0).to(tl.float32)  # [GROUP_PAD, HEAD_DIM]
    for i in range(BLOCKS_PER_PROGRAM):
        col = tl.program_id(0) * BLOCKS_PER_PROGRAM + i
        if HAS_IDS:
            block = tl.load(ids_ptr + head * stride_ih + col, mask=col < num_cols, other=0)
        else:
            block = col.to(tl.int64)
        # (vector masks: the interpreter cannot AND a tensor with a scalar mask)
        d_ok = offs_d * 0 + col < num_cols
        s_row = s_ptr + block * stride_sn + head * stride_sh + offs_d
        k_min = tl.load(s_row, mask=d_ok, other=0.0).to(tl.float32)  # [HEAD_DIM]
        k_max = tl.load(s_row + stride_sm, mask=d_ok, other=0.0).to(tl.float32)
        qs = q * ((k_max - k_min) / _LEVELS)[None, :]  # [GROUP_PAD, HEAD_DIM]
        operand = tl.minimum(tl.maximum(qs, -_FP16_MAX), _FP16_MAX).to(tl.float16)
        rows = c_ptr + block * stride_cn + head * stride_ch + offs_d[:, None] * (BLOCK_TOKENS // 2) + offs_t[None, :]
        row_ok = d_ok[:, None] & (offs_t < BLOCK_TOKENS // 2)[None, :]
        byte = tl.load(rows, mask=row_ok, other=0)  # uint8 [HEAD_DIM, HALF_PAD]
        est_lo = tl.dot(operand, nibble(byte, 0, DECODE))  # [GROUP_PAD, HALF_PAD]: tokens 0, 2, 4, ..
        est_hi = tl.dot(operand, nibble(byte, 1, DECODE))  # tokens 1, 3, 5, ..
        base = tl.sum(q * k_min[None, :], 1)  # [GROUP_PAD]
        spread = tl.sum(tl.abs(qs), 1)
        size = tl.sum(tl.abs(q) * (tl.abs(k_min) + tl.abs(k_max))[None, :], 1)
        quest = tl.sum(tl.maximum(q * k_max[None, :], q * k_min[None, :]), 1)
        big = tl.max(tl.abs(qs), 1)
        first = block * BLOCK_TOKENS + 2 * offs_t  # [HALF_PAD]: the low nibble's token
        ok_lo = (2 * offs_t < BLOCK_TOKENS) & (first < num_tokens) & (offs_t * 0 + col < num_cols)
        ok_hi = (2 * offs_t + 1 < BLOCK_TOKENS) & (first + 1 < num_tokens) & (offs_t * 0 + col < num_cols)
        logit_lo = tl.where(ok_lo[None, :], (est_lo + base[:, None]) * scale, float("-inf"))
        logit_hi = tl.where(ok_hi[None, :], (est_hi + base[:, None]) * scale, float("-inf"))
        top = tl.maximum(tl.max(logit_lo, 1), tl.max(logit_hi, 1))  # [GROUP_PAD]
        total = tl.sum(tl.exp(logit_lo - top[:, None]), 1) + tl.sum(tl.exp(logit_hi - top[:, None]), 1)
        lse = top + tl.log(total)
        fp16_err = _LEVELS * (_FP16_REL * spread + HEAD_DIM * _LEVELS * _FP16_TINY)
        err = (_HALF_STEP * spread + fp16_err + _ROUNDING_SLACK * size) * scale
        n_real = tl.sum(ok_lo.to(tl.float32), 0) + tl.sum(ok_hi.to(tl.float32), 0)
        quest_upper = tl.log(n_real) + (quest + _ROUNDING_SLACK * size) * scale
        upper = tl.where(big < _FP16_MAX, tl.minimum(lse + err, quest_upper), quest_upper) + _ABSOLUTE_SLACK
        out_ok = g_ok & (offs_g * 0 + col < num_cols)
        if MERGE:
            live = tl.load(valid_ptr + block, mask=col < num_cols, other=0) != 0
            kept = tl.load(keep_ptr + block, mask=col < num_cols, other=0) != 0
            after = tl.load(valid_ptr + block + 1, mask=(col < num_cols) & (block + 1 < num_blocks), other=0) != 0
            z = tl.load(z_ptr + head * GROUP + offs_g, mask=g_ok, other=0.0)
            z = tl.where(z == float("-inf"), float("inf"), z)  # nothing ranked: every share 0
            share = tl.sum(tl.where(g_ok, tl.exp(lse - z), 0.0), 0) / GROUP
            share = tl.where(live & ~after, 0.0, share)  # the tail (codes may lag its keys) ranks only if kept
            score = tl.where(live, tl.where(kept, float("inf"), share), float("-inf"))
            tl.store(lse_ptr + head * stride_oh + col, score, mask=col < num_cols)
            bound = upper_ptr + (head * GROUP + offs_g) * stride_uh + block
            live_ok = out_ok & (offs_g * 0 + live.to(tl.int32) > 0)
            tl.store(bound, tl.minimum(tl.load(bound, mask=live_ok, other=0.0), upper), mask=live_ok)
        else:
            out = (head * GROUP + offs_g) * stride_oh + col
            tl.store(lse_ptr + out, lse, mask=out_ok)
            tl.store(upper_ptr + out, upper, mask=out_ok)


def check_inputs(q: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor,
                 num_tokens: int) -> tuple[int, int, int]:
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
    if len({q.device, summaries.device, codes.device}) != 1:
        raise ValueError(f"q, summaries and codes must share a device, "
                         f"got {q.device}, {summaries.device}, {codes.device}")
    return num_blocks, num_kv_heads, block_tokens


def check_kernel_layout(q: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor, block_tokens: int) -> None:
    """What the kernels assume beyond check_inputs, or ValueError."""
    head_dim = summaries.shape[3]
    if q.stride(1) != 1 or summaries.stride(3) != 1 or codes.stride()[2:] != (codes.shape[3] * codes.shape[4],
                                                                                   codes.shape[4], 1):
        raise ValueError("q and summaries need a contiguous last dim, codes contiguous blocks")
    if head_dim & (head_dim - 1) or head_dim < 16 or block_tokens % 2:
        raise ValueError(f"the kernels need head_dim a power of two >= 16 and an even block size, "
                         f"got head_dim {head_dim}, block_tokens {block_tokens}")


def check_ids(block_ids: torch.Tensor, num_kv_heads: int, device: torch.device) -> None:
    if block_ids.dim() != 2 or block_ids.shape[0] != num_kv_heads or block_ids.dtype != torch.int64 \
            or block_ids.device != device:
        raise ValueError(f"block_ids: expected int64 [{num_kv_heads}, C] on {device}, got "
                         f"{block_ids.dtype} {list(block_ids.shape)} on {block_ids.device}")


def _launch(q, summaries, codes, num_tokens, block_ids, scale, out, upper, merge, knobs) -> None:
    num_blocks, _, num_kv_heads, head_dim = summaries.shape
    block_tokens = codes.shape[3]
    check_kernel_layout(q, summaries, codes, block_tokens)
    unknown = set(knobs) - set(DEFAULT_KNOBS)
    if unknown:
        raise ValueError(f"unknown knobs {sorted(unknown)}; expected some of {sorted(DEFAULT_KNOBS)}")
    knobs = {**DEFAULT_KNOBS, **knobs}  # GROUP_PAD >= 2 below: see sketch_channels.py (a triton 3.6 miscompile at 1)
    group = q.shape[0] // num_kv_heads
    num_cols = num_blocks if block_ids is None else block_ids.shape[1]
    if num_cols == 0:
        return
    ids = block_ids if block_ids is not None else out  # unused pointer when HAS_IDS is off
    z, keep, valid = merge or (out, out, out)
    per_program = knobs["blocks_per_program"]
    _fine_kernel[(triton.cdiv(num_cols, per_program), num_kv_heads)](
        q, summaries, codes, ids, out, upper, z, keep, valid, num_tokens, num_cols, num_blocks,
        1.0 / math.sqrt(head_dim) if scale is None else scale,
        q.stride(0), summaries.stride(0), summaries.stride(1), summaries.stride(2), codes.stride(0), codes.stride(1),
        ids.stride(0), out.stride(0), upper.stride(0),
        GROUP=group, GROUP_PAD=max(triton.next_power_of_2(group), 2), HEAD_DIM=head_dim, BLOCK_TOKENS=block_tokens,
        HALF_PAD=triton.next_power_of_2(block_tokens // 2), HAS_IDS=block_ids is not None, MERGE=merge is not None,
        BLOCKS_PER_PROGRAM=per_program, DECODE=knobs["decode"], num_warps=knobs["num_warps"],
        num_stages=knobs["num_stages"],
    )  # fmt: skip


def sketch_block_stats(q: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor, num_tokens: int, *,
                       block_ids: torch.Tensor | None = None, scale: float | None = None,
                       **knobs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse, upper) float32 [Hq, C]: per q head and block (C = num_blocks, or the columns of block_ids
    [H, C]) the log-sum-exp of the sketch's logit estimates and an upper bound on the true one.

    q: float16 [Hq, D]; summaries: float16 [N, 2, H, D]; codes: uint8 [>= N, H, 2, B, D // 4] (eviction/sketch.py);
    D a power of two >= 16, B even; scale defaults to 1 / sqrt(D). Sync-free: capturable in a CUDA graph.
    knobs (blocks_per_program, decode, num_warps, num_stages) override DEFAULT_KNOBS.
    """
    num_blocks, num_kv_heads, _ = check_inputs(q, summaries, codes, num_tokens)
    if block_ids is not None:
        check_ids(block_ids, num_kv_heads, q.device)
    num_cols = num_blocks if block_ids is None else block_ids.shape[1]
    lse = torch.empty(q.shape[0], num_cols, dtype=torch.float32, device=q.device)  # [Hq, C]
    upper = torch.empty_like(lse)
    _launch(q, summaries, codes, num_tokens, block_ids, scale, lse, upper, None, knobs)
    return lse, upper


def refine_candidates(q: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor, candidates: torch.Tensor,
                      z: torch.Tensor, keep: torch.Tensor, valid: torch.Tensor, upper: torch.Tensor, *,
                      num_tokens: int | None = None, scale: float | None = None, **knobs: int) -> torch.Tensor:
    """scores float32 [H, C] of the candidates [H, C] (int64) from their fine pass: the group mean of
    exp(lse - z) (z float32 [Hq]: each head's normalizer), +inf where `keep`, -inf outside `valid` (bool [N]),
    0 for a live block followed by a dead one (a tail, unless kept); the fine bound of each live candidate is
    min'ed into upper float32 [Hq, N] in place. num_tokens defaults to every token of every block (capacity-sized
    summaries and codes, as the captured step passes them). knobs override REFINE_KNOBS."""
    num_tokens = summaries.shape[0] * codes.shape[3] if num_tokens is None else num_tokens
    num_blocks, num_kv_heads, block_tokens = check_inputs(q, summaries, codes, num_tokens)
    check_ids(candidates, num_kv_heads, q.device)
    if z.shape != (q.shape[0],) or keep.shape != (num_blocks,) or valid.shape != (num_blocks,) \
            or upper.shape != (q.shape[0], num_blocks) or upper.dtype != torch.float32:
        raise ValueError(f"z [{q.shape[0]}], keep and valid [{num_blocks}], upper float32 [{q.shape[0]}, {num_blocks}] "
                         f"expected, got {list(z.shape)}, {list(keep.shape)}, {list(valid.shape)}, "
                         f"{upper.dtype} {list(upper.shape)}")
    scores = torch.empty(candidates.shape, dtype=torch.float32, device=q.device)  # [H, C]
    _launch(q, summaries, codes, num_tokens, candidates, scale, scores, upper, (z.float(), keep, valid),
            {**REFINE_KNOBS, **knobs})
    return scores


def sketch_block_stats_ref(q: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor, num_tokens: int, *,
                           block_ids: torch.Tensor | None = None,
                           scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of `sketch_block_stats` (same contract and the same fp16 rounding of q * step);
    also the CPU path. Any block size."""
    num_blocks, num_kv_heads, block_tokens = check_inputs(q, summaries, codes, num_tokens)
    head_dim = summaries.shape[3]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = q.shape[0] // num_kv_heads
    heads = torch.arange(num_kv_heads, device=q.device)[:, None]
    if block_ids is None:
        block_ids = torch.arange(num_blocks, device=q.device).expand(num_kv_heads, num_blocks)
    s = summaries.float()[block_ids, :, heads]  # [H, C, 2, D]
    low, high = s[:, :, 0], s[:, :, 1]
    code = unpack_codes(codes[block_ids, heads])  # [H, C, B, D]
    qg = q.float().view(num_kv_heads, group, head_dim)  # [H, G, D]
    qs = qg[:, :, None] * ((high - low) / LEVELS)[:, None]  # [H, G, C, D]
    operand = qs.clamp(-FP16_MAX, FP16_MAX).half().float()  # what the tensor cores multiply
    logit = (torch.einsum("hgd,hcd->hgc", qg, low)[..., None] + torch.einsum("hgcd,hcbd->hgcb", operand, code)) * scale
    real = block_ids[:, :, None] * block_tokens + torch.arange(block_tokens, device=q.device) < num_tokens  # [H,C,B]
    lse = torch.logsumexp(logit.masked_fill(~real[:, None], float("-inf")), dim=-1)  # [H, G, C]
    spread = qs.abs().sum(-1)
    size = torch.einsum("hgd,hcd->hgc", qg.abs(), low.abs() + high.abs())
    err = (HALF_STEP * spread + LEVELS * (FP16_REL * spread + head_dim * LEVELS * FP16_TINY) + ROUNDING_SLACK * size)
    quest = torch.einsum("hgd,hcd->hgc", qg.clamp(min=0), high) + torch.einsum("hgd,hcd->hgc", qg.clamp(max=0), low)
    quest_upper = real.sum(-1).float().log()[:, None] + (quest + ROUNDING_SLACK * size) * scale
    fits = qs.abs().amax(-1) < FP16_MAX
    upper = torch.where(fits, torch.minimum(lse + err * scale, quest_upper), quest_upper) + ABSOLUTE_SLACK
    return lse.flatten(0, 1), upper.flatten(0, 1)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2, B, D // 4] channel-major nibbles (eviction/sketch.py's layout) -> float32 codes [..., B, D]."""
    b, d = packed.shape[-2], packed.shape[-1] * 4
    flat = packed.flatten(-3).to(torch.int64)
    return torch.stack((flat & 15, flat >> 4), dim=-1).view(*packed.shape[:-3], d, b).transpose(-1, -2).float()
