"""Pool-partitioned block table for paged decode when a table mixes fp16 (hot) and int8 (warm) blocks.

Per (row, kv head), the used entries of the table are reordered so that its fp16 blocks come
first, in table order, and its int8 blocks after them, in reverse table order (one pass: int8
entries fill from the row's end). Each entry keeps its slot and its position in the original
table, so the split kernel can run one launch per pool, each a loop specialised to that pool's
format, and still store per-block mass where the table had the block. Everything stays on the
device (no count reaches the host): the launch is capturable in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

PARTITION_CHUNK = 2048  # table entries per step of the scan, and per program of the chunked one
_PREFIX = 1024  # earlier chunks' counts summed per step by a chunk's program


@triton.jit
def _scatter_chunk(table_row, is_int8_row, s_tab_blk, s_i8_blk, slot_out, pos_out, j0, n_blocks, fp16_before,
                   int8_before, CHUNK: tl.constexpr):
    """Entries j0 .. j0 + CHUNK of a row to their places, given how many fp16 / int8 entries come before them:
    fp16 ones after the earlier fp16 ones, int8 ones before the earlier int8 ones (from the row's end).
    Returns the chunk's fp16 and int8 counts."""
    blk = j0 + tl.arange(0, CHUNK)
    used = blk < n_blocks
    flags = tl.load(is_int8_row + blk * s_i8_blk, mask=used, other=0)
    int8 = used & (flags != 0)
    fp16 = used & (flags == 0)
    slot = tl.load(table_row + blk * s_tab_blk, mask=used, other=0)
    dest = tl.where(int8, n_blocks - int8_before - tl.cumsum(int8.to(tl.int32), 0),
                    fp16_before + tl.cumsum(fp16.to(tl.int32), 0) - 1)
    tl.store(slot_out + dest, slot, mask=used)
    tl.store(pos_out + dest, blk, mask=used)
    return tl.sum(fp16.to(tl.int32), 0), tl.sum(int8.to(tl.int32), 0)


@triton.jit
def _partition_kernel(
    table_ptr, is_int8_ptr, num_tokens_ptr, slot_ptr, pos_ptr, num_fp16_ptr,
    s_tab_batch, s_tab_head, s_tab_blk, s_i8_batch, s_i8_head, s_i8_blk, num_heads, max_blocks,
    BLOCK_TOKENS: tl.constexpr, CHUNK: tl.constexpr,
):
    """Program (b, head): stable scan of the row's used entries, chunk after chunk (a table of one chunk)."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    n_blocks = tl.minimum(tl.cdiv(tl.load(num_tokens_ptr + b), BLOCK_TOKENS), max_blocks)
    table_row = table_ptr + b * s_tab_batch + head * s_tab_head
    is_int8_row = is_int8_ptr + b * s_i8_batch + head * s_i8_head
    out_row = (b * num_heads + head) * max_blocks
    num_fp16 = 0
    num_int8 = 0
    for j0 in range(0, n_blocks, CHUNK):
        n16, n8 = _scatter_chunk(table_row, is_int8_row, s_tab_blk, s_i8_blk, slot_ptr + out_row, pos_ptr + out_row,
                                 j0, n_blocks, num_fp16, num_int8, CHUNK)
        num_fp16 += n16
        num_int8 += n8
    tl.store(num_fp16_ptr + b * num_heads + head, num_fp16)


@triton.jit
def _count_kernel(is_int8_ptr, num_tokens_ptr, counts_ptr, s_i8_batch, s_i8_head, s_i8_blk, num_heads, max_blocks,
                  num_chunks, BLOCK_TOKENS: tl.constexpr, CHUNK: tl.constexpr):
    """Program (b, head, chunk): the chunk's fp16 and int8 entry counts -> counts [B, H', chunks, 2]."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    chunk = tl.program_id(2)
    n_blocks = tl.minimum(tl.cdiv(tl.load(num_tokens_ptr + b), BLOCK_TOKENS), max_blocks)
    blk = chunk * CHUNK + tl.arange(0, CHUNK)
    used = blk < n_blocks
    flags = tl.load(is_int8_ptr + b * s_i8_batch + head * s_i8_head + blk * s_i8_blk, mask=used, other=0)
    n8 = tl.sum((used & (flags != 0)).to(tl.int32), 0)
    out = counts_ptr + ((b * num_heads + head) * num_chunks + chunk) * 2
    tl.store(out, tl.sum(used.to(tl.int32), 0) - n8)
    tl.store(out + 1, n8)


@triton.jit
def _scatter_kernel(
    table_ptr, is_int8_ptr, num_tokens_ptr, counts_ptr, slot_ptr, pos_ptr, num_fp16_ptr,
    s_tab_batch, s_tab_head, s_tab_blk, s_i8_batch, s_i8_head, s_i8_blk, num_heads, max_blocks, num_chunks,
    BLOCK_TOKENS: tl.constexpr, CHUNK: tl.constexpr, PREFIX: tl.constexpr,
):
    """Program (b, head, chunk): the chunk's entries to their places, the counts of the chunks before it summed."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    chunk = tl.program_id(2)
    n_blocks = tl.minimum(tl.cdiv(tl.load(num_tokens_ptr + b), BLOCK_TOKENS), max_blocks)
    row_counts = counts_ptr + (b * num_heads + head) * num_chunks * 2
    fp16_before = 0
    int8_before = 0
    for i0 in range(0, chunk, PREFIX):
        idx = i0 + tl.arange(0, PREFIX)
        earlier = idx < chunk
        fp16_before += tl.sum(tl.load(row_counts + idx * 2, mask=earlier, other=0), 0)
        int8_before += tl.sum(tl.load(row_counts + idx * 2 + 1, mask=earlier, other=0), 0)
    out_row = (b * num_heads + head) * max_blocks
    n16, _ = _scatter_chunk(table_ptr + b * s_tab_batch + head * s_tab_head,
                            is_int8_ptr + b * s_i8_batch + head * s_i8_head, s_tab_blk, s_i8_blk,
                            slot_ptr + out_row, pos_ptr + out_row, chunk * CHUNK, n_blocks, fp16_before, int8_before,
                            CHUNK)
    if chunk == num_chunks - 1:
        tl.store(num_fp16_ptr + b * num_heads + head, fp16_before + n16)


@dataclass(frozen=True, slots=True)
class PartitionedTable:
    """Row (b, h): entries [0, num_fp16[b, h]) are fp16 blocks, [num_fp16, ceil(num_tokens[b] / T)) int8 ones.

    slots and positions are int32 [B, H, max_blocks] (stride 0 over H when the table was shared by the
    kv heads); entries past a row's used blocks are undefined. num_fp16 is int32 [B, H], same strides.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    num_fp16: torch.Tensor


def partition_table(block_table: torch.Tensor, block_is_int8: torch.Tensor, num_tokens: torch.Tensor,
                    block_tokens: int, *, chunk: int = PARTITION_CHUNK,
                    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> PartitionedTable:
    """block_table int32 [B, H, M], block_is_int8 int8 [B, H, M] (checked by paged_decode) -> PartitionedTable.

    A table and flags that are one row expanded over the kv heads (stride 0) are partitioned once per row (H' = 1,
    else H' = H). A table of one chunk (M <= chunk entries, a power of two) is scanned by one program per row; a
    longer one by a program per chunk in two launches (counts, then the scatter): at 1M tokens a row is 16 chunks
    of 2,048, which one program takes ~43 us to walk on the H200 (BENCHMARKS.md, Int8 kernels).
    out: contiguous int32 buffers (slots [B, H', M], positions [B, H', M], num_fp16 [B, H']) to write into instead
    of new ones: what a caller that keeps a partition between launches (a captured decode step) gives.
    """
    batch, heads, max_blocks = block_table.shape
    shared = heads == 1 or (block_table.stride(1) == 0 and block_is_int8.stride(1) == 0)
    scan_heads = 1 if shared else heads
    dev = block_table.device
    if out is None:
        slots = torch.empty((batch, scan_heads, max_blocks), dtype=torch.int32, device=dev)  # [B, H', M]
        out = (slots, torch.empty_like(slots), torch.empty((batch, scan_heads), dtype=torch.int32, device=dev))
    slots, positions, num_fp16 = out  # [B, H', M], [B, H', M], [B, H']
    shapes = ((batch, scan_heads, max_blocks),) * 2 + ((batch, scan_heads),)
    if any(t.shape != s or t.dtype != torch.int32 or t.device != dev or not t.is_contiguous()
           for t, s in zip(out, shapes)):
        raise ValueError(f"partition_table out: contiguous int32 tensors of shapes {shapes} on {dev}")
    num_chunks = triton.cdiv(max_blocks, chunk)
    if num_chunks == 1:  # one launch, one program per row
        _partition_kernel[(batch, scan_heads)](
            block_table, block_is_int8, num_tokens, slots, positions, num_fp16,
            *block_table.stride(), *block_is_int8.stride(), scan_heads, max_blocks,
            BLOCK_TOKENS=block_tokens, CHUNK=chunk, num_warps=4,
        )
    elif num_chunks > 1:  # a program per chunk: count, then scatter after the earlier chunks' counts
        counts = torch.empty((batch, scan_heads, num_chunks, 2), dtype=torch.int32, device=dev)
        grid = (batch, scan_heads, num_chunks)
        _count_kernel[grid](block_is_int8, num_tokens, counts, *block_is_int8.stride(), scan_heads, max_blocks,
                            num_chunks, BLOCK_TOKENS=block_tokens, CHUNK=chunk, num_warps=4)
        _scatter_kernel[grid](
            block_table, block_is_int8, num_tokens, counts, slots, positions, num_fp16,
            *block_table.stride(), *block_is_int8.stride(), scan_heads, max_blocks, num_chunks,
            BLOCK_TOKENS=block_tokens, CHUNK=chunk, PREFIX=_PREFIX, num_warps=4,
        )
    else:
        num_fp16.zero_()
    return PartitionedTable(slots.expand(batch, heads, max_blocks), positions.expand(batch, heads, max_blocks),
                            num_fp16.expand(batch, heads))


def kept_or_new_partition(kept: PartitionedTable | None, block_table: torch.Tensor, block_is_int8: torch.Tensor,
                          num_tokens: torch.Tensor, block_tokens: int) -> PartitionedTable:
    """`kept` (a partition_table of this table made earlier, e.g. by a decode step between tokens), checked for the
    table's shape, or the table partitioned now."""
    if kept is None:
        return partition_table(block_table, block_is_int8, num_tokens, block_tokens)
    batch, heads, _ = block_table.shape
    if kept.slots.shape != block_table.shape or kept.num_fp16.shape != (batch, heads):
        raise ValueError(f"partition: a partition of this table {tuple(block_table.shape)}, got slots "
                         f"{tuple(kept.slots.shape)} and num_fp16 {tuple(kept.num_fp16.shape)}")
    return kept


def partition_table_ref(block_table: torch.Tensor, block_is_int8: torch.Tensor, num_tokens: torch.Tensor,
                        block_tokens: int) -> list[list[tuple[int, torch.Tensor, torch.Tensor]]]:
    """Per (b, h): (num_fp16, slots, positions) of the used entries, in the order partition_table gives."""
    rows = []
    for b in range(block_table.shape[0]):
        n_blocks = min(-(-int(num_tokens[b]) // block_tokens), block_table.shape[2])
        row = []
        for h in range(block_table.shape[1]):
            int8 = block_is_int8[b, h, :n_blocks].bool().cpu()
            order = torch.cat([torch.nonzero(~int8)[:, 0], torch.nonzero(int8)[:, 0].flip(0)])
            row.append((int((~int8).sum()), block_table[b, h, :n_blocks].cpu()[order], order.int()))
        rows.append(row)
    return rows
