"""Gather scattered rows of a pinned host slab straight into device memory, in one launch.

One copy call per block reaches ~12 GB/s of the 55 GB/s a pinned host-to-device link
gives (ANCHORS.md: 33 GB/s at best), and gathering on the host first costs a pass over
host memory. Pinned host memory is mapped into the GPU's address space (unified
addressing), so this kernel's loads read it over PCIe directly: every program copies
one chunk of one row, and all rows travel in a single launch. With `dst_rows` the rows land at
given positions of dst (a batch whose blocks live in several slabs: one launch per slab, no
temporary and no second copy).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_BLOCK = 2048  # 32-bit words per program: 8 KiB in flight per program


@triton.jit
def _gather_rows_kernel(src_ptr, rows_ptr, dst_ptr, dst_rows_ptr, row_words,
                        SCATTER: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < row_words
    row = tl.load(rows_ptr + i).to(tl.int64)
    if SCATTER:
        dst_row = tl.load(dst_rows_ptr + i).to(tl.int64)
    else:
        dst_row = i.to(tl.int64)
    words = tl.load(src_ptr + row * row_words + offs, mask=ok)
    tl.store(dst_ptr + dst_row * row_words + offs, words, mask=ok)


def gather_rows(src: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor | None = None) -> None:
    """dst[dst_rows[i]] = src[rows[i]] (dst_rows default: i) for 2-D int32 tensors: src in pinned host
    memory (or on dst's device), rows and dst_rows contiguous int64 [n] on dst's device, dst contiguous
    [m, src.shape[1]] with m >= n (m == n without dst_rows; dst_rows must be < m, distinct)."""
    n = rows.shape[0]
    if src.dim() != 2 or src.dtype != torch.int32 or not src.is_contiguous():
        raise ValueError(f"src: expected contiguous int32 [rows, words], got {src.dtype} {list(src.shape)}")
    if dst.dim() != 2 or dst.shape[1] != src.shape[1] or dst.dtype != torch.int32 or not dst.is_contiguous() \
            or dst.shape[0] < n or (dst_rows is None and dst.shape[0] != n):
        raise ValueError(f"dst: expected contiguous int32 [{n}{'+' if dst_rows is not None else ''}, {src.shape[1]}], "
                         f"got {dst.dtype} {list(dst.shape)}")
    for name, idx in (("rows", rows), ("dst_rows", dst_rows if dst_rows is not None else rows)):
        if idx.device != dst.device or idx.dtype != torch.int64 or idx.dim() != 1 or idx.shape[0] != n \
                or not idx.is_contiguous():
            raise ValueError(f"{name}: expected contiguous int64 [{n}] on {dst.device}, "
                             f"got {idx.dtype} {list(idx.shape)} on {idx.device}")
    if src.device.type == "cpu" and dst.device.type == "cuda" and not src.is_pinned():
        raise ValueError("src: host memory must be pinned for the GPU to read it")
    if dst.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("0", ""):
        gather_rows_ref(src, rows, dst, dst_rows)  # no compiled Triton for CPU tensors
    elif n:
        grid = (n, triton.cdiv(src.shape[1], _BLOCK))
        _gather_rows_kernel[grid](src, rows, dst, rows if dst_rows is None else dst_rows, src.shape[1],
                                  SCATTER=dst_rows is not None, BLOCK=_BLOCK, num_warps=4)


def gather_rows_ref(src: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor,
                    dst_rows: torch.Tensor | None = None) -> None:
    picked = src.index_select(0, rows.to(src.device)).to(dst.device)
    if dst_rows is None:
        dst.copy_(picked)
    else:
        dst.index_copy_(0, dst_rows, picked)
