"""Fused per-token math of the Llama layer: RMSNorm (optionally after a residual add), RoPE on q and k,
SiLU(gate) * up. One launch each where plain torch takes 2-9 elementwise kernels (each ~2 us even
inside a CUDA graph; bench_longctx/step_profile.py counts them).

Each kernel rounds where torch rounds: products and sums are formed in fp32 and cast to the tensors'
dtype at the same points as the reference below it (engine_adapter/llama.py's math, HF's rounding
order), so fp16/bf16 results differ from torch only where fp32 reduction order, the GPU's approximate
rsqrt/exp or a multiply-add the compiler contracts into one fma differ, by at most one ulp of the output
(bit for bit on the CPU, under the interpreter; one ulp on the H200: tests/engine_adapter/test_fused_ops.py). Launchers take any row stride (q/k/v and gate/up may be
column slices of one merged projection) and do no host syncs, so everything here can be captured in
a CUDA graph.

Layout: kernels -> launchers (input checks, grid) -> pure-torch references. Imports only torch and triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # [T, N], row stride stride_x; with HAS_DELTA the residual stream
    delta_ptr,  # [T, N]: added to x first (HAS_DELTA)
    w_ptr,  # [N]
    res_ptr,  # [T, N]: x + delta is written here (HAS_DELTA; may be x itself)
    out_ptr,  # [T, N] contiguous: the normed rows
    stride_x,
    stride_delta,
    stride_res,
    n,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,  # >= n, a power of two
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_delta + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x_ptr.dtype.element_ty)  # torch's x + delta
        tl.store(res_ptr + row * stride_res + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty)  # HF casts back to x's dtype before the weight
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * n + offs, w.to(tl.float32) * normed.to(tl.float32), mask=mask)


@triton.jit
def _rotate_row(src, dst, cos, sin, offs, HALF: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One head's row: dst = src * cos + rotate_half(src) * sin, rounded after each op like torch."""
    mask = offs < HEAD_DIM
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(src + (offs + HALF) % HEAD_DIM, mask=mask, other=0.0).to(tl.float32)
    rotated = tl.where(offs < HALF, -partner, partner)
    ty = dst.dtype.element_ty
    a = (x * cos).to(ty).to(tl.float32)
    b = (rotated * sin).to(ty).to(tl.float32)
    tl.store(dst + offs, a + b, mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,  # [T, Hq, D], last dim contiguous
    k_ptr,  # [T, Hkv, D], last dim contiguous
    cos_ptr,  # [T, D], last dim contiguous
    sin_ptr,
    q_out_ptr,  # [T, Hq, D] contiguous
    k_out_ptr,  # [T, Hkv, D] contiguous
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ct,
    stride_st,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q heads first, then k heads
    offs = tl.arange(0, BLOCK_D)
    mask = offs < HEAD_DIM
    cos = tl.load(cos_ptr + t * stride_ct + offs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_st + offs, mask=mask, other=0.0).to(tl.float32)
    if head < NUM_Q_HEADS:
        src = q_ptr + t * stride_qt + head * stride_qh
        dst = q_out_ptr + (t * NUM_Q_HEADS + head) * HEAD_DIM
        _rotate_row(src, dst, cos, sin, offs, HEAD_DIM // 2, HEAD_DIM)
    else:
        kv_head = head - NUM_Q_HEADS
        src = k_ptr + t * stride_kt + kv_head * stride_kh
        dst = k_out_ptr + (t * NUM_KV_HEADS + kv_head) * HEAD_DIM
        _rotate_row(src, dst, cos, sin, offs, HEAD_DIM // 2, HEAD_DIM)


@triton.jit
def _silu_mul_kernel(
    gate_ptr,  # [T, N], row stride stride_g
    up_ptr,  # [T, N], row stride stride_u
    out_ptr,  # [T, N] contiguous
    stride_g,
    stride_u,
    n,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)  # F.silu rounds to the dtype
    tl.store(out_ptr + row * n + offs, silu.to(tl.float32) * u, mask=mask)


def _check_rows(name: str, x: torch.Tensor, n: int | None = None) -> None:
    """x must be a [T, N] float tensor with a contiguous last dim."""
    if x.dim() != 2 or x.dtype not in _DTYPES or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"{name}: expected a float16/bfloat16/float32 [T, N] tensor with a contiguous last dim, "
                         f"got {x.dtype} {list(x.shape)} strides {x.stride()}")
    if n is not None and x.shape[1] != n:
        raise ValueError(f"{name}: expected {n} columns, got {list(x.shape)}")


def _check_like(name: str, x: torch.Tensor, other: torch.Tensor) -> None:
    if x.shape != other.shape or x.dtype != other.dtype or x.device != other.device:
        raise ValueError(f"{name}: expected {other.dtype} {list(other.shape)} on {other.device}, "
                         f"got {x.dtype} {list(x.shape)} on {x.device}")


def _num_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 8192 else 16


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual, normed): residual = x + delta (x itself when delta is None), normed = RMSNorm(residual) * weight,
    in one launch. x, delta [T, N] with a contiguous last dim; weight [N] of x's dtype. The residual is
    written into residual_out when given (x itself for an in-place residual stream), else a new tensor."""
    _check_rows("x", x)
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype or weight.device != x.device or \
            weight.stride(0) != 1:
        raise ValueError(f"weight: expected contiguous {x.dtype} [{x.shape[1]}] on {x.device}, "
                         f"got {weight.dtype} {list(weight.shape)} on {weight.device}")
    if delta is not None:
        _check_like("delta", delta, x)
        _check_rows("delta", delta)
        if residual_out is None:
            residual_out = torch.empty_like(x)  # [T, N]
        _check_like("residual_out", residual_out, x)
        _check_rows("residual_out", residual_out)
    elif residual_out is not None:
        raise ValueError("residual_out is only written when delta is given")
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)  # [T, N]
    if rows == 0:
        return (x if delta is None else residual_out), out
    block = triton.next_power_of_2(n)
    res = x if delta is None else residual_out
    _rmsnorm_kernel[(rows,)](
        x, x if delta is None else delta, weight, res, out,
        x.stride(0), res.stride(0) if delta is None else delta.stride(0), res.stride(0), n, eps,
        HAS_DELTA=delta is not None, BLOCK=block, num_warps=_num_warps(block),
    )  # fmt: skip
    return res, out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight [T, N] in one launch (HF LlamaRMSNorm's rounding order)."""
    return add_rmsnorm(x, None, weight, eps)[1]


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-split RoPE of q [T, Hq, D] and k [T, Hkv, D] (heads and D contiguous within a token; any token
    stride) with cos/sin [T, D], in one launch; returns new contiguous (q, k)."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[2] % 2:
        raise ValueError(f"q, k: expected [T, Hq, D] and [T, Hkv, D] with an even D, "
                         f"got {list(q.shape)} and {list(k.shape)}")
    t, num_q_heads, head_dim = q.shape
    for name, x in (("q", q), ("k", k)):
        if x.dtype not in _DTYPES or x.dtype != q.dtype or x.device != q.device or x.stride(2) != 1:
            raise ValueError(f"{name}: expected {q.dtype} on {q.device} with a contiguous last dim, "
                             f"got {x.dtype} on {x.device} strides {x.stride()}")
    for name, x in (("cos", cos), ("sin", sin)):
        if x.shape != (t, head_dim) or x.dtype != q.dtype or x.device != q.device or x.stride(1) != 1:
            raise ValueError(f"{name}: expected {q.dtype} [{t}, {head_dim}] on {q.device} with a contiguous "
                             f"last dim, got {x.dtype} {list(x.shape)} on {x.device}")
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype,
                                                                                      device=k.device)
    if t == 0:
        return q_out, k_out
    _rope_kernel[(t, num_q_heads + k.shape[1])](
        q, k, cos, sin, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=k.shape[1], HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1 if head_dim <= 128 else 2,
    )  # fmt: skip
    return q_out, k_out


def silu_mul(gate: torch.Tensor, up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """SiLU(gate) * up [T, N] in one launch; gate and up may be column slices of one [T, 2N] projection."""
    _check_rows("gate", gate)
    _check_rows("up", up)
    _check_like("up", up, gate)
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    rows, n = gate.shape
    out = torch.empty((rows, n), dtype=gate.dtype, device=gate.device)  # [T, N]
    if rows and n:
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](
            gate, up, out, gate.stride(0), up.stride(0), n, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out


def add_rmsnorm_ref(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                    residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch `add_rmsnorm` (the model's CPU path)."""
    if delta is not None:
        x = torch.add(x, delta) if residual_out is None else torch.add(x, delta, out=residual_out)
    return x, rmsnorm_ref(x, weight, eps)


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalize in fp32, cast back to x's dtype, then scale."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, half-split convention: x [T, H, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch `rope`."""
    return rotate_ref(q, cos, sin), rotate_ref(k, cos, sin)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Pure-torch `silu_mul`."""
    return torch.nn.functional.silu(gate) * up
