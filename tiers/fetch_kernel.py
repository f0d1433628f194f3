"""Gather scattered rows of a pinned host slab straight into device memory, in one launch.

One copy call per block reaches ~12 GB/s of the 55 GB/s a pinned host-to-device link
gives (ANCHORS.md: 33 GB/s at best), and gathering on the host first costs a pass over
host memory. Pinned host memory is mapped into the GPU's address space (unified
addressing), so this kernel's loads read it over PCIe directly: every program copies
one chunk of one row, and all rows travel in a single launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048  # 32-bit words per program: 8 KiB in flight per program


@triton.jit
def _gather_rows_kernel(src_ptr, rows_ptr, dst_ptr, row_words, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < row_words
    row = tl.load(rows_ptr + i).to(tl.int64)
    words = tl.load(src_ptr + row * row_words + offs, mask=ok)
    tl.store(dst_ptr + i.to(tl.int64) * row_words + offs, words, mask=ok)


def gather_rows(src: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[i] = src[rows[i]] for 2-D int32 tensors: src in pinned host memory (or on dst's device),
    rows int64 on dst's device, dst contiguous [len(rows), src.shape[1]]."""
    if src.dim() != 2 or src.dtype != torch.int32 or not src.is_contiguous():
        raise ValueError(f"src: expected contiguous int32 [rows, words], got {src.dtype} {list(src.shape)}")
    if dst.shape != (rows.shape[0], src.shape[1]) or dst.dtype != torch.int32 or not dst.is_contiguous():
        raise ValueError(f"dst: expected contiguous int32 [{rows.shape[0]}, {src.shape[1]}], got {list(dst.shape)}")
    if rows.device != dst.device or rows.dtype != torch.int64:
        raise ValueError(f"rows: expected int64 on {dst.device}, got {rows.dtype} on {rows.device}")
    if src.device.type == "cpu" and dst.device.type == "cuda" and not src.is_pinned():
        raise ValueError("src: host memory must be pinned for the GPU to read it")
    if rows.shape[0]:
        grid = (rows.shape[0], triton.cdiv(src.shape[1], _BLOCK))
        _gather_rows_kernel[grid](src, rows, dst, src.shape[1], BLOCK=_BLOCK, num_warps=4)


def gather_rows_ref(src: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(src.index_select(0, rows.to(src.device)))
