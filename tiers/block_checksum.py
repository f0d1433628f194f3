"""Block checksums computed where the block is, on the GPU beside the cpu tier: one launch per batch.

A block's bytes are read as signed 32-bit words w_0 .. w_{W-1} (an int8 block: its data, then
k_scale, then v_scale, positions running on across the fields) and summed into two 64-bit lanes:

    S1 = sum_p w_p                   exact, no wrap-around: |S1| < W 2^31 < 2^63
    S2 = sum_p m_p w_p   mod 2^64    m_p = K (2 pi(p) + 1) mod 2^64

pi is a bijection of 32-bit integers (lowbias32: xorshift-multiply steps, each invertible) and K is
odd, so every m_p is odd and no two of them are equal mod 2^33. For blocks under 2^31 words, a
change d_p = w'_p - w_p of one word has 0 < |d_p| < 2^32, so 2 divides it at most 31 times, and:

- every change of one word (any bit flip, any set of flips within it) moves S1 by d_p != 0;
- every change of two words p != q (two flips in two words, a swapped pair) keeps S1 only if
  d_q = -d_p, and then moves S2 by d_p (m_p - m_q) = 2 K d_p (pi(p) - pi(q)): a power of two of
  at most 1 + 31 + 31 = 63, so nonzero mod 2^64;
- zeroing a block is seen unless its S1 and S2 were both 0 (test: a zeroed row);
- wider damage: the check is linear, so damage passes only if sum_p d_p = 0 and
  sum_p d_p m_p = 0 mod 2^64; with multipliers that look random to it, that is about 2^-64, and
  2^-33 in the worst case (only the top bit of several words flipped: S2 sees them mod 2^33).
  Fletcher's weights (m_p = p) let +1, -2, +1 on three neighbouring words through; hashed
  multipliers have no such pattern. Against damage, not an adversary (nor is xxh3 keyed).

Cost: every word is loaded once, its multiplier comes from a table (8 bytes a word, shared by all
blocks, so it stays in L2), one 64-bit multiply-add and one add. The sums run at memory speed on
the GPU, or at PCIe speed where the GPU reads pinned host rows (the cpu tier's fetch computes them
while it gathers: gather_slab_rows in tiers/fetch_kernel.py); a CPU computes them with the
torch reference at 0.2-0.5 GB/s a core against xxh3's ~29 GB/s (2-core box, 128 KiB blocks),
which is why tiers on hosts without a GPU keep xxh3.

Layout: kernel -> launcher -> torch reference. Imports only torch and triton.
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

import torch
import triton
import triton.language as tl

from tiers.block_rows import normal_device

_BLOCK = 2048  # 32-bit words per loop step of a program (8 KiB in flight)
_K = 0x5851F42D4C957F2D  # odd


@triton.jit
def _field_sums(ptr, row, words, first, mult_ptr, s1, s2, BLOCK: tl.constexpr):
    base = ptr + row * words
    for start in range(0, words, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < words
        w = tl.load(base + offs, mask=ok, other=0).to(tl.int64)
        m = tl.load(mult_ptr + first + offs, mask=ok, other=0)
        s1 += w
        s2 += w * m  # wraps mod 2^64
    return s1, s2


@triton.jit
def _block_sums_kernel(a_ptr, a_words, b_ptr, b_words, c_ptr, c_words, rows_ptr, mult_ptr, out_ptr,
                       NUM_FIELDS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    s1 = tl.zeros([BLOCK], dtype=tl.int64)
    s2 = tl.zeros([BLOCK], dtype=tl.int64)
    s1, s2 = _field_sums(a_ptr, row, a_words, 0, mult_ptr, s1, s2, BLOCK)
    if NUM_FIELDS > 1:
        s1, s2 = _field_sums(b_ptr, row, b_words, a_words, mult_ptr, s1, s2, BLOCK)
    if NUM_FIELDS > 2:
        s1, s2 = _field_sums(c_ptr, row, c_words, a_words + b_words, mult_ptr, s1, s2, BLOCK)
    tl.store(out_ptr + 2 * i, tl.sum(s1, axis=0))
    tl.store(out_ptr + 2 * i + 1, tl.sum(s2, axis=0))


def block_sums(fields: Sequence[torch.Tensor], rows: torch.Tensor | None = None,
               device: torch.device | str | None = None) -> torch.Tensor:
    """Checksums (S1, S2) int64 [n, 2] on `device` of blocks `rows` (int64 [n] on `device`; default: every
    row) of `fields`: 1 to 3 contiguous tensors with one row per block (an fp16 batch: (blocks,); int8:
    data, k_scale, v_scale), each row a whole number of 32-bit words, on `device` or in pinned host
    memory that the device reads itself. `device` defaults to that of rows, else of fields[0]."""
    words = _checked_words(fields)
    device = normal_device(device if device is not None else rows.device if rows is not None else fields[0].device)
    for i, w in enumerate(words):
        if w.device != device and not (w.device.type == "cpu" and device.type == "cuda" and w.is_pinned()):
            raise ValueError(f"fields[{i}]: expected on {device} or pinned host memory, "
                             f"got {w.device}{' (pageable)' if w.device.type == 'cpu' else ''}")
    if rows is None:
        rows = torch.arange(words[0].shape[0], dtype=torch.int64, device=device)
    if rows.dim() != 1 or rows.dtype != torch.int64 or rows.device != device or not rows.is_contiguous():
        raise ValueError(f"rows: expected contiguous int64 [n] on {device}, got {rows.dtype} {list(rows.shape)} "
                         f"on {rows.device}")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("0", ""):
        return block_sums_ref(fields, rows)  # no compiled Triton for CPU tensors: the same sums in torch
    out = torch.empty((rows.shape[0], 2), dtype=torch.int64, device=device)
    if rows.shape[0]:
        total = sum(w.shape[1] for w in words)
        padded = [*words, *[words[0]] * (3 - len(words))]  # unused pointer slots (NUM_FIELDS skips them)
        args = [x for w in padded for x in (w, w.shape[1])]
        _block_sums_kernel[(rows.shape[0],)](*args, rows, multipliers(total, device), out,
                                             NUM_FIELDS=len(words), BLOCK=_BLOCK, num_warps=4)
    return out


def _checked_words(fields: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each field as int32 [rows, words], or ValueError saying what is wrong."""
    if not 1 <= len(fields) <= 3:
        raise ValueError(f"fields: expected 1 to 3 tensors, got {len(fields)}")
    out = []
    for i, f in enumerate(fields):
        row_bytes = f[0].numel() * f.element_size() if f.dim() and f.shape[0] else 0
        if f.dim() < 2 or not f.is_contiguous() or f.shape[0] != fields[0].shape[0] or row_bytes % 4:
            raise ValueError(f"fields[{i}]: expected contiguous [{fields[0].shape[0]}, ...] rows of whole 32-bit "
                             f"words, got {f.dtype} {list(f.shape)}{'' if f.is_contiguous() else ' (strided)'}")
        row_elements = 1
        for size in f.shape[1:]:
            row_elements *= size
        out.append(f.reshape(f.shape[0], row_elements).view(torch.uint8).view(torch.int32))  # 0 rows too
    if sum(w.shape[1] for w in out) >= 2**31:
        raise ValueError("fields: a block of 2^31 words or more (the proofs need fewer)")
    return out


@functools.lru_cache(maxsize=16)
def multipliers(num_words: int, device: torch.device) -> torch.Tensor:
    """m_p = K (2 pi(p) + 1) mod 2^64 for p < num_words: int64 [num_words] on `device`."""
    mask = 0xFFFFFFFF
    x = torch.arange(num_words, dtype=torch.int64)
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & mask  # int64 products wrap; the low 32 bits are exact
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & mask
    x = x ^ (x >> 16)  # pi(p): lowbias32, a bijection of [0, 2^32)
    return ((2 * x + 1) * _K).to(device)


def block_sums_ref(fields: Sequence[torch.Tensor], rows: torch.Tensor | None = None) -> torch.Tensor:
    """block_sums in torch on the CPU (any device's tensors; the result on rows' device)."""
    words = torch.cat([w.cpu() for w in _checked_words(fields)], dim=1)  # int32 [N, W]
    picked = words if rows is None else words[rows.cpu()]
    w = picked.to(torch.int64)
    s2 = (w * multipliers(w.shape[1], torch.device("cpu"))).sum(dim=1)  # wraps mod 2^64
    out = torch.stack([w.sum(dim=1), s2], dim=1)
    return out if rows is None else out.to(rows.device)


def head_sums(fields: Sequence[torch.Tensor], num_heads: int) -> torch.Tensor:
    """(S1, S2) of every block per kv head: int64 [n, num_heads, 2] on the fields' device, each over the words of
    one head's slices (its K and V rows, its scales) at their positions in the whole block, so that summed over
    the heads they are the block's block_sums (S2 mod 2^64). A step that reads one head's slice of a block
    (kvstore/decode/step.py, tiers/slice_gather.py) can verify it alone. fields: a block batch's (fp16: (blocks,);
    int8: data, k_scale, v_scale), each [n, 2, H, ...] (K and V) or [n, H, ...] (scales). Torch, any device."""
    words = _checked_words(fields)
    device = words[0].device
    mult = multipliers(sum(w.shape[1] for w in words), device)
    out = torch.zeros((words[0].shape[0], num_heads, 2), dtype=torch.int64, device=device)
    first = 0
    for field, w in zip(fields, words):
        parts, heads = (field.shape[1], field.shape[2]) if field.dim() == 5 else (1, field.shape[1])
        if heads != num_heads:
            raise ValueError(f"head_sums: expected {num_heads} heads in a field of shape {list(field.shape)}")
        n, total = w.shape
        per_head = w.to(torch.int64).view(n, parts, num_heads, -1)
        out[..., 0] += per_head.sum(dim=(1, 3))
        out[..., 1] += (per_head * mult[first:first + total].view(parts, num_heads, -1)).sum(dim=(1, 3))  # wraps
        first += total
    return out


def sum_device(checksums: str, pin: bool) -> torch.device | None:
    """The device computing the cpu tier's block sums for `checksums` ("auto", "host" or a device), None for
    xxh3 on the host; pin: whether the tier's slabs are pinned (a GPU reads them itself)."""
    if checksums == "host" or (checksums == "auto" and not (pin and torch.cuda.is_available())):
        return None
    try:
        device = torch.device("cuda" if checksums == "auto" else checksums)
    except (RuntimeError, TypeError):
        raise ValueError(f"cpu tier: checksums: expected 'auto', 'host' or a device, got {checksums!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"cpu tier: checksums: expected a cpu or cuda device, got {device}")
    if device.type == "cuda" and not (pin and torch.cuda.is_available()):
        raise ValueError(f"cpu tier: checksums on {device} need CUDA and pinned slabs (pin=True)")
    return normal_device(device)
