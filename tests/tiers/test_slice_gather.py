"""Staging one kv head's slice of the cpu blocks a step selected (tiers/slice_gather.py): the kernel
(TRITON_INTERPRET=1 on CPU; pinned host -> GPU on CUDA) against its torch reference and against the
blocks the tier holds; per-head sums that add up to the block sums; a damaged slice counted only where
it is read."""

from __future__ import annotations

import pytest
import torch

from tiers.block_checksum import block_sums_ref, head_sums
from tiers.block_rows import fields
from tiers.cpu import CpuTier
from tiers.layout import BlockLayout, QuantBlocks
from tiers.slice_gather import (stage_cold_slices, stage_cold_slices_ref, stage_cold_slices_rows,
                                stage_cold_slices_rows_ref)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LAYOUT = BlockLayout(num_kv_heads=3, block_tokens=8, head_dim=16)
CPU, WARM = 2, 1
NUM_BLOCKS, POSITIONS, K, FIRST = 10, 24, 5, 4


def blocks(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *LAYOUT.shape), generator=g).half()


@pytest.mark.parametrize("dtype", ["int8", "float16"])
def test_head_sums_add_up_to_the_block_sums(dtype):
    tier = CpuTier(LAYOUT, 1 << 20, dtype, pin=False, checksums="cpu")
    tier.put(list(range(6)), blocks(6, 0))
    batch = tier.get(list(range(6)))
    heads = head_sums(fields(batch), LAYOUT.num_kv_heads)  # [6, H, 2]
    assert torch.equal(heads.sum(dim=1), block_sums_ref(fields(batch)))
    slots = torch.tensor(tier.slots.lookup(list(range(6))))
    assert torch.equal(tier.head_sums[slots], heads)  # what put recorded
    damaged = [f.clone() for f in fields(batch)]
    damaged[0][2, 1, 1, 3, 5] += 1  # block 2, V, head 1
    moved = head_sums(damaged, LAYOUT.num_kv_heads) != heads
    assert moved[2, 1].any() and not moved[2, 0].any() and not moved[2, 2].any() and not moved[[0, 1, 3, 4, 5]].any()


def case(dtype: str, seed: int):
    """A cpu tier holding NUM_BLOCKS blocks, a table of POSITIONS entries (cpu ones point at them, the others
    say warm), a selection [H, K], the step's block table for it and a pool with staging rows."""
    tier = CpuTier(LAYOUT, 1 << 20, dtype, pin=DEVICE.type == "cuda", checksums=str(DEVICE))
    tier.put(list(range(100, 100 + NUM_BLOCKS)), blocks(NUM_BLOCKS, seed).to(DEVICE))
    g = torch.Generator().manual_seed(seed)
    tier_map = torch.full((POSITIONS,), WARM, dtype=torch.int8)
    slot_map = torch.randint(0, 50, (POSITIONS,), generator=g, dtype=torch.int32)
    cold = torch.randperm(POSITIONS, generator=g)[:NUM_BLOCKS]
    tier_map[cold] = CPU
    slot_map[cold] = torch.tensor(tier.slots.lookup(list(range(100, 100 + NUM_BLOCKS))), dtype=torch.int32)
    selected = torch.stack([torch.randperm(POSITIONS, generator=g)[:K].sort().values for _ in range(3)])
    slots = slot_map[selected].clone()
    is_int8 = torch.ones_like(selected, dtype=torch.bool)
    pool = LAYOUT.empty("int8", FIRST + K + 2, DEVICE) if dtype == "int8" else LAYOUT.empty_fp16(FIRST + K + 2, DEVICE)
    for f in fields(pool):
        f.view(torch.uint8).fill_(0xAB)
    dev = [x.to(DEVICE) for x in (tier_map, slot_map, selected, slots, is_int8)]
    return tier, dev, pool


@pytest.mark.parametrize("dtype, seed", [("int8", 1), ("float16", 2), ("int8", 3)])
def test_slices_match_the_reference_and_the_tier(dtype, seed):
    tier, (tier_map, slot_map, selected, slots, is_int8), pool = case(dtype, seed)
    table = tier.slab_table(DEVICE)
    want = [slots.clone(), is_int8.clone(), [f.clone() for f in fields(pool)], torch.zeros(2, dtype=torch.int64)]
    counts = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    reads = torch.full((POSITIONS,), 5, dtype=torch.int32, device=DEVICE)
    want_reads = reads.clone()
    stage_cold_slices(selected, tier_map, slot_map, slots, is_int8, table, tier.head_sums, fields(pool), FIRST, CPU,
                      counts, reads)
    per_head = [w // (3 * (2 if i == 0 else 1)) for i, w in enumerate(table.words)] + [0, 0]
    stage_cold_slices_ref(selected, tier_map, slot_map, want[0], want[1], table, tier.head_sums,
                          [f.view(f.shape[0], -1).view(torch.int32) for f in want[2]], FIRST, CPU, want[3],
                          want_reads, per_head)
    assert torch.equal(slots, want[0]) and torch.equal(is_int8, want[1])
    assert all(torch.equal(a, b) for a, b in zip(fields(pool), want[2]))
    cold = (tier_map[selected] == CPU).cpu()
    assert counts.tolist() == want[3].tolist() == [0, int(cold.sum())]
    # reads: one per head that staged the block (heads may pick the same block), added to what was there
    expected = torch.full((POSITIONS,), 5, dtype=torch.int32)
    expected.index_add_(0, selected.cpu()[cold], torch.ones(int(cold.sum()), dtype=torch.int32))
    assert torch.equal(reads.cpu(), expected) and torch.equal(want_reads.cpu(), expected)
    # what the attention kernel will read for each entry: head h of its row is the block's head h
    ids = {int(s): 100 + i for i, s in enumerate(tier.slots.lookup(list(range(100, 100 + NUM_BLOCKS))))}
    for h, j in cold.nonzero().tolist():
        assert int(slots[h, j]) == FIRST + j and bool(is_int8[h, j]) == (dtype == "int8")
        block = tier.get([ids[int(slot_map[selected[h, j]])]])
        if isinstance(block, QuantBlocks):
            assert torch.equal(pool.data[FIRST + j, :, h].cpu(), block.data[0, :, h])
            assert torch.equal(pool.k_scale[FIRST + j, h].cpu(), block.k_scale[0, h])
            assert torch.equal(pool.v_scale[FIRST + j, h].cpu(), block.v_scale[0, h])
        else:
            assert torch.equal(pool[FIRST + j, :, h].cpu(), block[0, :, h])
    warm = ~cold
    assert torch.equal(slots.cpu()[warm], slot_map.cpu()[selected.cpu()][warm])  # GPU-held entries untouched
    assert bool(is_int8.cpu()[warm].all())
    assert all(bool((f[:FIRST].view(torch.uint8) == 0xAB).all()) for f in fields(pool))  # rows below FIRST untouched


def test_a_damaged_slice_is_counted_where_it_is_read():
    tier, (tier_map, slot_map, selected, slots, is_int8), pool = case("int8", 4)
    cold = (tier_map[selected] == CPU).cpu()
    h, j = cold.nonzero()[0].tolist()
    slot = int(slot_map[selected[h, j]])
    slab, row = divmod(slot, tier.slab_blocks)
    tier.slabs[slab].data[row, 0, h, 2, 3] ^= 4  # one bit of head h's K
    reads = sum(1 for hh, jj in cold.nonzero().tolist()
                if hh == h and int(slot_map[selected[hh, jj]]) == slot)
    counts = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    stage_cold_slices(selected, tier_map, slot_map, slots, is_int8, tier.slab_table(DEVICE), tier.head_sums,
                      fields(pool), FIRST, CPU, counts, torch.zeros(POSITIONS, dtype=torch.int32, device=DEVICE))
    assert counts.tolist() == [reads, int(cold.sum())] and reads >= 1


def rows_case(dtype: str, seed: int):
    """One cpu tier and four rows of tables over it, of 24, 17, 9 and 13 positions: rows 0 and 2 select cpu
    blocks, staged into pool rows of their own (from 2 + K and from 2), row 1 has no staging rows (first row -1:
    its cpu entries stay as they are), row 3 holds no cpu block (its staging rows from 2K + 2 stay untouched)."""
    tier = CpuTier(LAYOUT, 1 << 20, dtype, pin=DEVICE.type == "cuda", checksums=str(DEVICE))
    tier.put(list(range(100, 100 + NUM_BLOCKS)), blocks(NUM_BLOCKS, seed).to(DEVICE))
    cpu_slots = torch.tensor(tier.slots.lookup(list(range(100, 100 + NUM_BLOCKS))), dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    tier_maps, slot_maps, selected = [], [], []
    for positions, num_cold in ((24, 10), (17, 6), (9, 7), (13, 0)):
        tier_map = torch.full((positions,), WARM, dtype=torch.int8)
        slot_map = torch.randint(0, 50, (positions,), generator=g, dtype=torch.int32)
        cold = torch.randperm(positions, generator=g)[:num_cold]
        tier_map[cold] = CPU
        slot_map[cold] = cpu_slots[torch.randperm(NUM_BLOCKS, generator=g)[:num_cold]]
        tier_maps.append(tier_map.to(DEVICE))
        slot_maps.append(slot_map.to(DEVICE))
        selected.append(torch.stack([torch.randperm(positions, generator=g)[:K].sort().values for _ in range(3)]))
    selected = torch.stack(selected).to(DEVICE)  # [R, H, K]
    slots = torch.stack([m[s] for m, s in zip(slot_maps, selected)]).contiguous()
    is_int8 = torch.ones_like(selected, dtype=torch.bool)
    first_rows = torch.tensor([2 + K, -1, 2, 2 * K + 2], dtype=torch.int64, device=DEVICE)
    pool = LAYOUT.empty("int8", 3 * K + 2, DEVICE) if dtype == "int8" else LAYOUT.empty_fp16(3 * K + 2, DEVICE)
    for f in fields(pool):
        f.view(torch.uint8).fill_(0xAB)
    counts = [torch.zeros(2, dtype=torch.int64, device=DEVICE) for _ in range(4)]
    reads = [torch.full((len(m),), 3, dtype=torch.int32, device=DEVICE) for m in tier_maps]
    return tier, (tier_maps, slot_maps, selected, slots, is_int8, first_rows), pool, counts, reads


def stage_rows(tier, case_tensors, pool, counts, reads) -> None:
    tier_maps, slot_maps, selected, slots, is_int8, first_rows = case_tensors
    addresses = [torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=DEVICE)
                 for ts in (tier_maps, slot_maps, counts, reads)]
    stage_cold_slices_rows(selected, tier_maps, slot_maps, slots, is_int8, tier.slab_table(DEVICE), tier.head_sums,
                           fields(pool), first_rows, CPU, counts, reads, addresses)


@pytest.mark.parametrize("dtype, seed", [("int8", 5), ("float16", 6)])
def test_rows_stage_what_each_row_stages_alone(dtype, seed):
    """One launch over four rows (the kernel; TRITON_INTERPRET=1 on CPU) against the torch reference and
    against stage_cold_slices row by row: the same pool rows, tables, counts and reads; the empty row and the
    row without cpu blocks keep their tables, and no row writes another's staging rows."""
    tier, case_tensors, pool, counts, reads = rows_case(dtype, seed)
    tier_maps, slot_maps, selected, slots, is_int8, first_rows = case_tensors
    before = (slots.clone(), is_int8.clone())
    alone = [x.clone() for x in (slots, is_int8)], [f.clone() for f in fields(pool)]
    alone_counts, alone_reads = [c.clone() for c in counts], [r.clone() for r in reads]
    for r, first in enumerate(first_rows.tolist()):
        if first >= 0:
            stage_cold_slices(selected[r], tier_maps[r], slot_maps[r], alone[0][0][r], alone[0][1][r],
                              tier.slab_table(DEVICE), tier.head_sums, alone[1], first, CPU, alone_counts[r],
                              alone_reads[r])
    ref = [x.clone() for x in (slots, is_int8)], [f.clone() for f in fields(pool)]
    ref_counts, ref_reads = [c.clone() for c in counts], [r.clone() for r in reads]
    stage_rows(tier, case_tensors, pool, counts, reads)
    table = tier.slab_table(DEVICE)
    stage_cold_slices_rows_ref(selected, tier_maps, slot_maps, *ref[0], table, tier.head_sums,
                               [f.view(f.shape[0], -1).view(torch.int32) for f in ref[1]], first_rows, CPU,
                               ref_counts, ref_reads, [w // (3 * (2 if i == 0 else 1)) for i, w in
                                                      enumerate(table.words)] + [0, 0])
    for want_tables, want_pool, want_counts, want_reads in ((alone[0], alone[1], alone_counts, alone_reads),
                                                            (ref[0], ref[1], ref_counts, ref_reads)):
        assert torch.equal(slots, want_tables[0]) and torch.equal(is_int8, want_tables[1])
        assert all(torch.equal(a, b) for a, b in zip(fields(pool), want_pool))
        assert [c.tolist() for c in counts] == [c.tolist() for c in want_counts]
        assert all(torch.equal(a, b) for a, b in zip(reads, want_reads))
    cold = [(m[s] == CPU).cpu() for m, s in zip(tier_maps, selected)]
    assert int(cold[0].sum()) and int(cold[1].sum()) and int(cold[2].sum()) and not int(cold[3].sum())
    assert [c.tolist() for c in counts] == [[0, int(cold[0].sum())], [0, 0], [0, int(cold[2].sum())], [0, 0]]
    for r in (1, 3):  # the empty row and the row without cpu blocks: tables and reads as they were
        assert torch.equal(slots[r], before[0][r]) and torch.equal(is_int8[r], before[1][r])
        assert bool((reads[r] == 3).all())
    for r in (0, 2):
        first = int(first_rows[r])
        assert torch.equal(slots[r][cold[r].to(DEVICE)].cpu(), (first + cold[r].nonzero()[:, 1]).int())
    untouched = [0, 1, *range(2 * K + 2, 3 * K + 2)]  # below row 2's, and row 3's (it staged nothing)
    assert all(bool((f[untouched].view(torch.uint8) == 0xAB).all()) for f in fields(pool))


def test_a_damaged_slice_is_counted_in_the_rows_that_read_it_only():
    tier, case_tensors, pool, counts, reads = rows_case("int8", 7)
    tier_maps, slot_maps, selected, slots, is_int8, first_rows = case_tensors
    cold = (tier_maps[2][selected[2]] == CPU).cpu()
    h, j = cold.nonzero()[0].tolist()
    slot = int(slot_maps[2][selected[2, h, j]])
    slab, row = divmod(slot, tier.slab_blocks)
    tier.slabs[slab].data[row, 1, h, 3, 2] ^= 8  # one bit of head h's V, in a block row 2 reads
    damaged = [sum(1 for hh, jj in (tier_maps[r][selected[r]] == CPU).nonzero().tolist()
                   if hh == h and int(slot_maps[r][selected[r, hh, jj]]) == slot) for r in range(4)]
    stage_rows(tier, case_tensors, pool, counts, reads)
    assert damaged[2] >= 1 and [c.tolist()[0] for c in counts] == [damaged[0], 0, damaged[2], 0]
