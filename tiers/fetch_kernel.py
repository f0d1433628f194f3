"""Gather scattered rows of pinned host slabs straight into device memory, in one launch.

One copy call per block reaches ~12 GB/s of the ~53 GB/s one large pinned host-to-device
copy gives on the H200 host (bench_longctx.fetch_bench; BENCHMARKS.md, Tiers), and gathering
on the host first costs a pass over host memory. Pinned host memory is mapped into the GPU's
address space (unified addressing), so these kernels' loads read it over PCIe directly: every
program copies one chunk of one row, and all rows travel in a single launch.

- gather_rows: rows of one tensor, optionally to given rows of dst.
- gather_slab_rows: the blocks of a cpu tier by slot, every slab and every field of a block
  (fp16: one; int8: data, k_scale, v_scale) in one launch. The device addresses of the slabs'
  fields sit in a small table (SlabTable), so a batch spread over many slabs needs no launch
  per slab and no sorting by slab on the host. With `sums`, each block's checksum lanes
  (S1, S2 of tiers/block_checksum.py, word positions running on across the fields) are
  computed from the words while they pass through registers: every program adds its chunk's
  two partial sums to its block's row of `sums` with 64-bit atomic adds. Sums mod 2^64 do not
  depend on the order of the adds, so the result is exact and the same in every run, and a
  verified fetch needs no second read of the gathered rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from tiers.block_checksum import block_sums_ref, multipliers
from tiers.block_rows import normal_device

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
    _check_dst("dst", dst, n, src.shape[1], dst_rows is not None)
    _check_index("rows", rows, n, dst.device)
    if dst_rows is not None:
        _check_index("dst_rows", dst_rows, n, dst.device)
    if src.device.type == "cpu" and dst.device.type == "cuda" and not src.is_pinned():
        raise ValueError("src: host memory must be pinned for the GPU to read it")
    if not _triton_runs_on(dst.device):
        gather_rows_ref(src, rows, dst, dst_rows)
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


@triton.jit
def _address_kernel(ptr, out_ptr):
    tl.store(out_ptr, ptr.to(tl.int64))  # the address the launcher resolved (a pinned host row's device address)


@triton.jit
def _copy_chunk(address_ptr, row, dst_ptr, dst_row, words, start, first, mult_ptr, sums_ptr,
                SUMS: tl.constexpr, BLOCK: tl.constexpr):
    """Words [start, start + BLOCK) of a block's row in one field, which are the block's words first + start ..:
    copied to dst_row, and with SUMS their S1 and S2 added to sums_ptr[0] and sums_ptr[1]."""
    # fields are 16-byte aligned; the hint goes on the pointer (int_to_ptr drops the integer's): 128-bit loads
    src_ptr = tl.multiple_of(tl.load(address_ptr).to(tl.pointer_type(tl.int32)), 16)
    offs = start + tl.arange(0, BLOCK)
    ok = offs < words
    w = tl.load(src_ptr + row * words + offs, mask=ok, other=0)
    tl.store(dst_ptr + dst_row * words + offs, w, mask=ok)
    if SUMS:
        m = tl.load(mult_ptr + first + offs, mask=ok, other=0)
        w = w.to(tl.int64)
        tl.atomic_add(sums_ptr, tl.sum(w, axis=0), sem="relaxed")
        tl.atomic_add(sums_ptr + 1, tl.sum(w * m, axis=0), sem="relaxed")  # wraps mod 2^64: exact in any order


@triton.jit
def _gather_slab_rows_kernel(addresses_ptr, num_fields, slots_ptr, slab_rows, dst_rows_ptr,
                             a_ptr, a_words, b_ptr, b_words, c_ptr, c_words, mult_ptr, sums_ptr,
                             SCATTER: tl.constexpr, SUMS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    chunk = tl.program_id(1)  # over the fields' chunks in turn: a's, then b's, then c's
    slot = tl.load(slots_ptr + i)
    slab = slot // slab_rows
    row = slot - slab * slab_rows
    address_ptr = addresses_ptr + slab * num_fields
    if SCATTER:
        dst_row = tl.load(dst_rows_ptr + i)
    else:
        dst_row = i.to(tl.int64)
    sums_ptr += 2 * i
    a_chunks = tl.cdiv(a_words, BLOCK)
    b_chunks = tl.cdiv(b_words, BLOCK)
    if chunk < a_chunks:
        _copy_chunk(address_ptr, row, a_ptr, dst_row, a_words, chunk * BLOCK, 0, mult_ptr, sums_ptr,
                    SUMS, BLOCK)
    elif chunk < a_chunks + b_chunks:
        _copy_chunk(address_ptr + 1, row, b_ptr, dst_row, b_words, (chunk - a_chunks) * BLOCK, a_words,
                    mult_ptr, sums_ptr, SUMS, BLOCK)
    else:
        _copy_chunk(address_ptr + 2, row, c_ptr, dst_row, c_words, (chunk - a_chunks - b_chunks) * BLOCK,
                    a_words + b_words, mult_ptr, sums_ptr, SUMS, BLOCK)


@dataclass(frozen=True, slots=True)
class SlabTable:
    """Equal slabs of block rows and where `device` reads them. slabs: per slab its 1 to 3 fields, each int32
    [slab_rows, words] in pinned host memory (or on `device`); addresses: int64 [>= num_slabs, num_fields] on
    `device`, each field's address as the device's loads see it (held here with the slabs it points into)."""

    slabs: tuple[tuple[torch.Tensor, ...], ...]
    addresses: torch.Tensor
    device: torch.device

    @property
    def slab_rows(self) -> int:
        return self.slabs[0][0].shape[0]

    @property
    def words(self) -> list[int]:
        """Words of a block's row in each field."""
        return [f.shape[1] for f in self.slabs[0]]


def slab_table(slabs: Sequence[Sequence[torch.Tensor]], device: torch.device | str, capacity: int = 0) -> SlabTable:
    """The SlabTable of `slabs` (at least one; each 1 to 3 contiguous int32 [slab_rows, words] fields, the
    same shapes in every slab, 16-byte aligned) for `device`; one tiny launch per field. capacity: rows of the
    address table (at least len(slabs)), so that add_slab can extend it in place up to that many slabs."""
    device = normal_device(device)
    if not slabs or not 1 <= len(slabs[0]) <= 3:
        raise ValueError(f"slabs: expected at least one slab of 1 to 3 fields, got {len(slabs)} slabs")
    shapes = [tuple(f.shape) for f in slabs[0]]
    if any(len(shape) != 2 for shape in shapes) or sum(shape[1] for shape in shapes) > 65535 * _BLOCK:
        raise ValueError(f"slabs[0]: expected [slab_rows, words] fields, at most {65535 * _BLOCK} words a block "
                         f"(the grid's second dimension), got {[list(shape) for shape in shapes]}")
    table = SlabTable((), torch.zeros((max(capacity, len(slabs)), len(shapes)), dtype=torch.int64, device=device),
                      device)
    for slab in slabs:
        table = add_slab(table, slab, shapes)
    return table


def add_slab(table: SlabTable, slab: Sequence[torch.Tensor],
             shapes: Sequence[tuple[int, ...]] | None = None) -> SlabTable:
    """`table` with `slab` (fields shaped like the table's) after its slabs, its addresses written into the next
    row of the same address tensor: a captured graph that reads the table's addresses stays valid (the rows it
    reads are unchanged). ValueError when the address tensor is full or the slab does not fit the table."""
    s = len(table.slabs)
    shapes = shapes or [tuple(f.shape) for f in table.slabs[0]]
    if s >= table.addresses.shape[0]:
        raise ValueError(f"slab table: room for {table.addresses.shape[0]} slabs, all taken")
    if len(slab) != len(shapes):
        raise ValueError(f"slabs[{s}]: expected {len(shapes)} fields like slabs[0], got {len(slab)}")
    device = table.device
    for f, field in enumerate(slab):
        if tuple(field.shape) != shapes[f] or field.dtype != torch.int32 or not field.is_contiguous() \
                or field.data_ptr() % 16:
            raise ValueError(f"slabs[{s}][{f}]: expected contiguous 16-byte aligned int32 {list(shapes[f])}, "
                             f"got {field.dtype} {list(field.shape)}")
        if field.device != device and not (field.device.type == "cpu" and device.type == "cuda"
                                            and field.is_pinned()):
            raise ValueError(f"slabs[{s}][{f}]: expected on {device} or pinned host memory, got {field.device}"
                             f"{' (pageable)' if field.device.type == 'cpu' else ''}")
    if _triton_runs_on(device):
        for f, field in enumerate(slab):
            _address_kernel[(1,)](field, table.addresses[s, f:])
    return SlabTable((*table.slabs, tuple(slab)), table.addresses, device)


def gather_slab_rows(table: SlabTable, slots: torch.Tensor, dsts: Sequence[torch.Tensor],
                     sums: torch.Tensor | None = None, dst_rows: torch.Tensor | None = None) -> None:
    """For every field f: dsts[f][dst_rows[i]] = row slots[i] % slab_rows of slab slots[i] // slab_rows (dst_rows
    default: i), in one launch. slots, dst_rows: contiguous int64 [n] on table.device (slots < num_slabs *
    slab_rows; dst_rows < m, distinct); dsts: contiguous int32 [m, words of field f] on table.device, m >= n (m == n
    without dst_rows). sums: int64 [n, 2] on table.device, usually zeros: block i's (S1, S2) are added to sums[i]."""
    n, words = slots.shape[0], table.words
    _check_index("slots", slots, n, table.device)
    if dst_rows is not None:
        _check_index("dst_rows", dst_rows, n, table.device)
    if len(dsts) != len(words):
        raise ValueError(f"dsts: expected {len(words)} fields, got {len(dsts)}")
    for f, dst in enumerate(dsts):
        _check_dst(f"dsts[{f}]", dst, n, words[f], dst_rows is not None, table.device)
    if sums is not None and (sums.shape != (n, 2) or sums.dtype != torch.int64 or not sums.is_contiguous()
                             or sums.device != table.device):
        raise ValueError(f"sums: expected contiguous int64 [{n}, 2] on {table.device}, "
                         f"got {sums.dtype} {list(sums.shape)} on {sums.device}")
    if not _triton_runs_on(table.device):
        gather_slab_rows_ref(table, slots, dsts, sums, dst_rows)
    elif n:
        padded = [(d, w) for d, w in zip(dsts, words)] + [(dsts[0], 0)] * (3 - len(words))  # unused: no chunks
        args = [x for pair in padded for x in pair]
        mult = multipliers(sum(words), table.device) if sums is not None else slots
        grid = (n, sum(triton.cdiv(w, _BLOCK) for w in words))
        _gather_slab_rows_kernel[grid](table.addresses, len(words), slots, table.slab_rows,
                                       slots if dst_rows is None else dst_rows, *args, mult,
                                       slots if sums is None else sums, SCATTER=dst_rows is not None,
                                       SUMS=sums is not None, BLOCK=_BLOCK, num_warps=4)


def gather_slab_rows_ref(table: SlabTable, slots: torch.Tensor, dsts: Sequence[torch.Tensor],
                         sums: torch.Tensor | None = None, dst_rows: torch.Tensor | None = None) -> None:
    """gather_slab_rows in torch (any device's tensors)."""
    slab_of, row_of = (slots.cpu() // table.slab_rows).tolist(), (slots.cpu() % table.slab_rows).tolist()
    picked = [torch.stack([table.slabs[s][f][r].cpu() for s, r in zip(slab_of, row_of)])  # [n, words]
              if slab_of else table.slabs[0][f][:0].cpu() for f in range(len(dsts))]
    for dst, rows in zip(dsts, picked):
        gather_rows_ref(rows, torch.arange(len(rows), device=dst.device), dst, dst_rows)
    if sums is not None:
        sums += block_sums_ref(picked).to(sums.device)  # wraps mod 2^64, like the kernel's adds


def _triton_runs_on(device: torch.device) -> bool:
    """Whether kernels run for tensors on `device`: CUDA, or the CPU under TRITON_INTERPRET=1 (else: torch)."""
    return device.type != "cpu" or os.environ.get("TRITON_INTERPRET", "0") not in ("0", "")


def _check_dst(name: str, dst: torch.Tensor, n: int, words: int, scatter: bool,
               device: torch.device | None = None) -> None:
    if dst.dim() != 2 or dst.shape[1] != words or dst.dtype != torch.int32 or not dst.is_contiguous() \
            or dst.shape[0] < n or (not scatter and dst.shape[0] != n) or (device is not None and dst.device != device):
        where = "" if device is None else f" on {device}"
        raise ValueError(f"{name}: expected contiguous int32 [{n}{'+' if scatter else ''}, {words}]{where}, "
                         f"got {dst.dtype} {list(dst.shape)} on {dst.device}")


def _check_index(name: str, idx: torch.Tensor, n: int, device: torch.device) -> None:
    if idx.device != device or idx.dtype != torch.int64 or idx.dim() != 1 or idx.shape[0] != n \
            or not idx.is_contiguous():
        raise ValueError(f"{name}: expected contiguous int64 [{n}] on {device}, "
                         f"got {idx.dtype} {list(idx.shape)} on {idx.device}")
