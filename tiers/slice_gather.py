"""Stage the cpu-tier blocks a decode step selected, one kv head's slice each, verified on the device.

A captured decode step (kvstore/decode/step.py) cannot ask the host which selected blocks are cold, so this
launch does it on the device: for each entry (h, j) of the step's block table [H, k] whose block lies in
the cpu tier, it reads only head h's slice of the block (K and V rows, and its scales for int8) from the
pinned slab row, over PCIe, into staging row `first + j` of the GPU pool of the tier's format, sums the
slice on the way (tiers/block_checksum.py: S1, S2 at the words' positions in the whole block), compares
with the head's recorded sums, and points the entry at the staging row. Entries of GPU-held blocks are
left as they are. One row serves all heads (head h only writes and only reads its own slice of row
first + j), so k staging rows serve any selection, and every layer reuses them in stream order.

A slice whose sums differ adds 1 to `damaged` (its data is attended anyway: the step cannot stop
half way); the host reads the counter when it next syncs and raises IntegrityError then
(DecodeStep.verify). A head's slice of a 64-token int8 block is 1/8 of the block: a step reads only
what the kernel will attend. Each staged slice also adds 1 to its block's entry of `reads` (table
positions), which the step reads at block boundaries to promote the blocks it keeps reading.

Layout: kernel -> launcher -> torch reference. Imports only torch, triton and tiers/.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from tiers.block_checksum import multipliers
from tiers.fetch_kernel import SlabTable, _triton_runs_on

_BLOCK = 1024  # words per loop step


@triton.jit
def _copy_slice(address_ptr, row, row_words, dst_ptr, dst_row, offset, count, first, mult_ptr, s1, s2,
                BLOCK: tl.constexpr):
    """Words [offset, offset + count) of a block's row in one field (block positions first + offset ..): copied
    to dst_row, their S1 and S2 added to s1 and s2."""
    src_ptr = tl.load(address_ptr).to(tl.pointer_type(tl.int32))
    for start in range(0, count, BLOCK):
        offs = offset + start + tl.arange(0, BLOCK)
        ok = offs < offset + count
        w = tl.load(src_ptr + row * row_words + offs, mask=ok, other=0)
        tl.store(dst_ptr + dst_row * row_words + offs, w, mask=ok)
        m = tl.load(mult_ptr + first + offs, mask=ok, other=0)
        w = w.to(tl.int64)
        s1 += w
        s2 += w * m  # wraps mod 2^64
    return s1, s2


@triton.jit
def _stage_slices_kernel(sel_ptr, tier_ptr, slot_map_ptr, slots_ptr, flags_ptr, addresses_ptr, slab_rows,
                         sums_ptr, mult_ptr, counts_ptr, reads_ptr, d0_ptr, d1_ptr, d2_ptr, c0, c1, c2, first_row,
                         num_heads, cpu_tier, s_sel, s_slots, s_flags,
                         NUM_FIELDS: tl.constexpr, IS_INT8: tl.constexpr, BLOCK: tl.constexpr):
    h = tl.program_id(0)
    j = tl.program_id(1)
    pos = tl.load(sel_ptr + h * s_sel + j)
    if tl.load(tier_ptr + pos) == cpu_tier:
        slot = tl.load(slot_map_ptr + pos).to(tl.int64)
        slab = slot // slab_rows
        row = slot - slab * slab_rows
        dst_row = (first_row + j).to(tl.int64)
        address_ptr = addresses_ptr + slab * NUM_FIELDS
        s1 = tl.zeros([BLOCK], dtype=tl.int64)
        s2 = tl.zeros([BLOCK], dtype=tl.int64)
        w0 = 2 * num_heads * c0  # field 0: K and V, [2, H, c0] words a block
        s1, s2 = _copy_slice(address_ptr, row, w0, d0_ptr, dst_row, h * c0, c0, 0, mult_ptr, s1, s2, BLOCK)
        s1, s2 = _copy_slice(address_ptr, row, w0, d0_ptr, dst_row, (num_heads + h) * c0, c0, 0, mult_ptr, s1, s2,
                             BLOCK)
        if NUM_FIELDS > 1:  # int8: k_scale [H, c1], then v_scale [H, c2]
            s1, s2 = _copy_slice(address_ptr + 1, row, num_heads * c1, d1_ptr, dst_row, h * c1, c1, w0, mult_ptr,
                                 s1, s2, BLOCK)
            s1, s2 = _copy_slice(address_ptr + 2, row, num_heads * c2, d2_ptr, dst_row, h * c2, c2,
                                 w0 + num_heads * c1, mult_ptr, s1, s2, BLOCK)
        want = sums_ptr + (slot * num_heads + h) * 2
        bad = (tl.sum(s1, axis=0) != tl.load(want)) | (tl.sum(s2, axis=0) != tl.load(want + 1))
        tl.atomic_add(counts_ptr, bad.to(tl.int64), sem="relaxed")
        tl.atomic_add(counts_ptr + 1, tl.full((), 1, tl.int64), sem="relaxed")
        tl.atomic_add(reads_ptr + pos, tl.full((), 1, tl.int32), sem="relaxed")  # heads may share a block
        tl.store(slots_ptr + h * s_slots + j, dst_row.to(tl.int32))
        tl.store(flags_ptr + h * s_flags + j, IS_INT8)


def stage_cold_slices(selected: torch.Tensor, tier_map: torch.Tensor, slot_map: torch.Tensor, slots: torch.Tensor,
                      is_int8: torch.Tensor, table: SlabTable, head_sums: torch.Tensor, pool: Sequence[torch.Tensor],
                      first_row: int, cpu_tier: int, counts: torch.Tensor, reads: torch.Tensor) -> None:
    """For every entry (h, j) of `selected` (int64 [H, k] table positions) whose tier_map entry is cpu_tier: head h's
    slice of the cpu block in slot slot_map[pos] copied into row first_row + j of `pool`, verified against
    head_sums[slot, h], and slots[h, j] = first_row + j, is_int8[h, j] = the pool is int8. Sync-free, one launch.

    tier_map int8 and slot_map int32 [>= positions]; slots int32 and is_int8 bool [H, k], contiguous, rewritten in
    place; table: the cpu tier's slabs as this device reads them; head_sums int64 [cpu slots, H, 2]; pool: the
    GPU pool's fields in the cpu tier's format (fp16: (pool,); int8: data, k_scale, v_scale), rows the block
    layout's; counts int64 [2]: damaged slices and staged slices are added to counts[0] and counts[1];
    reads int32 [>= positions]: reads[pos] += 1 per slice staged from the block at table position pos."""
    heads, k = selected.shape
    fields = [p.view(p.shape[0], -1).view(torch.int32) for p in pool]
    if len(fields) not in (1, 3) or len(fields) != len(table.words) or any(
            f.shape[1] != w for f, w in zip(fields, table.words)):
        raise ValueError(f"pool: expected fields of {table.words} words a row, got {[f.shape[1] for f in fields]}")
    if reads.dtype != torch.int32 or not reads.is_contiguous() or reads.device != selected.device:
        raise ValueError(f"reads: expected contiguous int32 on {selected.device}, got {reads.dtype} on "
                         f"{reads.device}")
    if first_row + k > fields[0].shape[0]:
        raise ValueError(f"pool: {k} staging rows from {first_row} do not fit {fields[0].shape[0]} rows")
    if slots.shape != (heads, k) or is_int8.shape != (heads, k) or not (slots.is_contiguous() and
                                                                       is_int8.is_contiguous()):
        raise ValueError(f"slots and is_int8: expected contiguous [{heads}, {k}]")
    if k == 0 or not table.slabs:
        return
    per_head = [w // (heads * (2 if i == 0 else 1)) for i, w in enumerate(table.words)] + [0, 0]
    if not _triton_runs_on(selected.device):
        return stage_cold_slices_ref(selected, tier_map, slot_map, slots, is_int8, table, head_sums, fields,
                                     first_row, cpu_tier, counts, reads, per_head)
    padded = fields + [fields[0]] * (3 - len(fields))
    _stage_slices_kernel[(heads, k)](
        selected, tier_map, slot_map, slots, is_int8.view(torch.int8), table.addresses, table.slab_rows, head_sums,
        multipliers(sum(table.words), selected.device), counts, reads, *padded, *per_head[:3], first_row, heads,
        cpu_tier,
        selected.stride(0), slots.stride(0), is_int8.stride(0),
        NUM_FIELDS=len(fields), IS_INT8=int(len(fields) == 3), BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip


def stage_cold_slices_ref(selected, tier_map, slot_map, slots, is_int8, table, head_sums, fields, first_row, cpu_tier,
                          counts, reads, per_head) -> None:
    """stage_cold_slices in torch (host syncs; the CPU path and the kernel's reference)."""
    heads, k = selected.shape
    mult = multipliers(sum(table.words), torch.device("cpu"))
    sel = selected.cpu()
    cold = (tier_map.cpu()[sel] == cpu_tier).tolist()
    for h in range(heads):
        for j in range(k):
            if not cold[h][j]:
                continue
            slot = int(slot_map[sel[h, j]])
            slab, row = divmod(slot, table.slab_rows)
            s1 = s2 = torch.zeros((), dtype=torch.int64)
            first = 0
            for f, field in enumerate(fields):
                src = table.slabs[slab][f][row].cpu()
                parts = 2 if f == 0 else 1
                for part in range(parts):
                    lo = (part * heads + h) * per_head[f]
                    w = src[lo: lo + per_head[f]]
                    field[first_row + j, lo: lo + per_head[f]] = w.to(field.device)
                    w = w.to(torch.int64)
                    s1 = s1 + w.sum()
                    s2 = s2 + (w * mult[first + lo: first + lo + per_head[f]]).sum()
                first += table.words[f]
            want = head_sums[slot, h].cpu()
            counts[0] += int(bool(s1 != want[0]) or bool(s2 != want[1]))
            counts[1] += 1
            reads[sel[h, j]] += 1
            slots[h, j] = first_row + j
            is_int8[h, j] = len(fields) == 3
