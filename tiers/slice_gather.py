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

stage_cold_slices_rows does the same for R sequences' tables in one launch (a batch of rows that sequences join
and leave: kvstore/decode/batch_slots.py): each row's tier map, slot map, counters and `reads` are read through
int64 address arrays [R] and its first staging row from a device tensor [R], so the launch stays valid when a
row changes hands; a row whose first staging row is negative (an empty row, a member without staging rows)
stages nothing. Both launches run one jit body per entry (_stage_slice), and the rows' torch reference is the
single one, row by row.

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
def _stage_slice(h, j, pos, tier_ptr, slot_map_ptr, slot_out, flag_out, addresses_ptr, slab_rows, sums_ptr, mult_ptr,
                 counts_ptr, reads_ptr, d0_ptr, d1_ptr, d2_ptr, c0, c1, c2, first_row, num_heads, cpu_tier,
                 NUM_FIELDS: tl.constexpr, IS_INT8: tl.constexpr, BLOCK: tl.constexpr):
    """Entry (h, j) of one sequence's block table, table position pos: if its block is in the cpu tier, head h's
    slice staged into row first_row + j, verified, counted, and the entry (slot_out, flag_out) pointed at it."""
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
        tl.store(slot_out, dst_row.to(tl.int32))
        tl.store(flag_out, IS_INT8)


@triton.jit
def _stage_slices_kernel(sel_ptr, tier_ptr, slot_map_ptr, slots_ptr, flags_ptr, addresses_ptr, slab_rows,
                         sums_ptr, mult_ptr, counts_ptr, reads_ptr, d0_ptr, d1_ptr, d2_ptr, c0, c1, c2, first_row,
                         num_heads, cpu_tier, s_sel, s_slots, s_flags,
                         NUM_FIELDS: tl.constexpr, IS_INT8: tl.constexpr, BLOCK: tl.constexpr):
    """Program (head h, entry j) of one sequence's table."""
    h = tl.program_id(0)
    j = tl.program_id(1)
    pos = tl.load(sel_ptr + h * s_sel + j)
    _stage_slice(h, j, pos, tier_ptr, slot_map_ptr, slots_ptr + h * s_slots + j, flags_ptr + h * s_flags + j,
                 addresses_ptr, slab_rows, sums_ptr, mult_ptr, counts_ptr, reads_ptr, d0_ptr, d1_ptr, d2_ptr, c0, c1,
                 c2, first_row, num_heads, cpu_tier, NUM_FIELDS, IS_INT8, BLOCK)


@triton.jit
def _stage_slices_rows_kernel(sel_ptr, tier_addrs, slot_addrs, count_addrs, read_addrs, first_rows_ptr, slots_ptr,
                              flags_ptr, addresses_ptr, slab_rows, sums_ptr, mult_ptr, d0_ptr, d1_ptr, d2_ptr, c0, c1,
                              c2, num_heads, cpu_tier, s_sel_r, s_sel, s_slots_r, s_slots, s_flags_r, s_flags,
                              NUM_FIELDS: tl.constexpr, IS_INT8: tl.constexpr, BLOCK: tl.constexpr):
    """Program (head h, entry j, row r): _stage_slices_kernel's over the tables row r's addresses point at."""
    h = tl.program_id(0)
    j = tl.program_id(1)
    r = tl.program_id(2)
    first_row = tl.load(first_rows_ptr + r)
    if first_row >= 0:  # a row without staging rows stages nothing
        pos = tl.load(sel_ptr + r * s_sel_r + h * s_sel + j)
        tier_ptr = tl.load(tier_addrs + r).to(tl.pointer_type(tl.int8))
        slot_map_ptr = tl.load(slot_addrs + r).to(tl.pointer_type(tl.int32))
        counts_ptr = tl.load(count_addrs + r).to(tl.pointer_type(tl.int64))
        reads_ptr = tl.load(read_addrs + r).to(tl.pointer_type(tl.int32))
        _stage_slice(h, j, pos, tier_ptr, slot_map_ptr, slots_ptr + r * s_slots_r + h * s_slots + j,
                     flags_ptr + r * s_flags_r + h * s_flags + j, addresses_ptr, slab_rows, sums_ptr, mult_ptr,
                     counts_ptr, reads_ptr, d0_ptr, d1_ptr, d2_ptr, c0, c1, c2, first_row, num_heads, cpu_tier,
                     NUM_FIELDS, IS_INT8, BLOCK)


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
    fields = _checked_fields(pool, table, slots, is_int8, (heads, k))
    _check_counters(counts, reads, selected.device)
    if first_row + k > fields[0].shape[0]:
        raise ValueError(f"pool: {k} staging rows from {first_row} do not fit {fields[0].shape[0]} rows")
    if k == 0 or not table.slabs:
        return
    per_head = _per_head(table, heads)
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


def stage_cold_slices_rows(selected: torch.Tensor, tier_maps: Sequence[torch.Tensor],
                           slot_maps: Sequence[torch.Tensor], slots: torch.Tensor, is_int8: torch.Tensor,
                           table: SlabTable, head_sums: torch.Tensor, pool: Sequence[torch.Tensor],
                           first_rows: torch.Tensor, cpu_tier: int, counts: Sequence[torch.Tensor],
                           reads: Sequence[torch.Tensor], addresses: Sequence[torch.Tensor]) -> None:
    """stage_cold_slices for R sequences' tables in one launch: row r of `selected`, `slots` and `is_int8`
    ([R, H, k]) is staged as stage_cold_slices stages one sequence's, over tier_maps[r], slot_maps[r], counts[r]
    and reads[r], into pool rows first_rows[r] .. first_rows[r] + k - 1 (first_rows int64 [R] on the device; a
    negative first row: row r stages nothing). Rows' staging rows must not overlap. Sync-free.

    addresses: int64 [R] each on the device, the addresses of tier_maps, slot_maps, counts and reads in that order
    (what the kernel reads, so a batch rewrites a row's between launches; the lists are for the checks and the
    torch reference)."""
    rows, heads, k = selected.shape
    fields = _checked_fields(pool, table, slots, is_int8, (rows, heads, k))
    if not (len(tier_maps) == len(slot_maps) == len(counts) == len(reads) == rows) or len(addresses) != 4 or any(
            a.shape != (rows,) or a.dtype != torch.int64 or a.device != selected.device for a in addresses) or \
            first_rows.shape != (rows,) or first_rows.dtype != torch.int64 or not selected.is_contiguous():
        raise ValueError(f"stage_cold_slices_rows: {rows} rows need {rows} tier maps, slot maps, counts and reads, "
                         f"four int64 [{rows}] address arrays, int64 [{rows}] first rows and a contiguous selection")
    if any(t.dtype != torch.int8 for t in tier_maps) or any(s.dtype != torch.int32 for s in slot_maps):
        raise ValueError("stage_cold_slices_rows: int8 tier maps and int32 slot maps expected")
    for c, r in zip(counts, reads):
        _check_counters(c, r, selected.device)
    if rows == 0 or k == 0 or not table.slabs:
        return
    per_head = _per_head(table, heads)
    if not _triton_runs_on(selected.device):
        return stage_cold_slices_rows_ref(selected, tier_maps, slot_maps, slots, is_int8, table, head_sums, fields,
                                          first_rows, cpu_tier, counts, reads, per_head)
    padded = fields + [fields[0]] * (3 - len(fields))
    flags = is_int8.view(torch.int8)
    _stage_slices_rows_kernel[(heads, k, rows)](
        selected, *addresses, first_rows, slots, flags, table.addresses, table.slab_rows, head_sums,
        multipliers(sum(table.words), selected.device), *padded, *per_head[:3], heads, cpu_tier,
        selected.stride(0), selected.stride(1), slots.stride(0), slots.stride(1), flags.stride(0), flags.stride(1),
        NUM_FIELDS=len(fields), IS_INT8=int(len(fields) == 3), BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip


def _checked_fields(pool: Sequence[torch.Tensor], table: SlabTable, slots: torch.Tensor, is_int8: torch.Tensor,
                    shape: tuple[int, ...]) -> list[torch.Tensor]:
    """The pool's fields as int32 [rows, words], checked against the slabs' words; slots and is_int8 checked."""
    fields = [p.view(p.shape[0], -1).view(torch.int32) for p in pool]
    if len(fields) not in (1, 3) or len(fields) != len(table.words) or any(
            f.shape[1] != w for f, w in zip(fields, table.words)):
        raise ValueError(f"pool: expected fields of {table.words} words a row, got {[f.shape[1] for f in fields]}")
    if slots.shape != shape or is_int8.shape != shape or not (slots.is_contiguous() and is_int8.is_contiguous()) \
            or slots.dtype != torch.int32 or is_int8.dtype != torch.bool:
        raise ValueError(f"slots and is_int8: expected contiguous int32 and bool {list(shape)}")
    return fields


def _check_counters(counts: torch.Tensor, reads: torch.Tensor, device: torch.device) -> None:
    if counts.shape != (2,) or counts.dtype != torch.int64 or counts.device != device:
        raise ValueError(f"counts: expected int64 [2] on {device}, got {counts.dtype} {list(counts.shape)} on "
                         f"{counts.device}")
    if reads.dtype != torch.int32 or not reads.is_contiguous() or reads.device != device:
        raise ValueError(f"reads: expected contiguous int32 on {device}, got {reads.dtype} on {reads.device}")


def _per_head(table: SlabTable, heads: int) -> list[int]:
    """Words of one head's slice in each field (K and V halves of field 0 each), padded to three fields."""
    return [w // (heads * (2 if i == 0 else 1)) for i, w in enumerate(table.words)] + [0, 0]


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


def stage_cold_slices_rows_ref(selected, tier_maps, slot_maps, slots, is_int8, table, head_sums, fields, first_rows,
                               cpu_tier, counts, reads, per_head) -> None:
    """stage_cold_slices_rows in torch: stage_cold_slices_ref row by row (rows with a negative first row skipped)."""
    k = selected.shape[2]
    for r, first_row in enumerate(first_rows.tolist()):
        if first_row < 0:
            continue
        if first_row + k > fields[0].shape[0]:
            raise ValueError(f"pool: {k} staging rows from {first_row} do not fit {fields[0].shape[0]} rows")
        stage_cold_slices_ref(selected[r], tier_maps[r], slot_maps[r], slots[r], is_int8[r], table, head_sums, fields,
                              first_row, cpu_tier, counts[r], reads[r], per_head)
