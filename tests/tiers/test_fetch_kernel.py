"""The zero-copy row gathers against torch: gather_rows against index_select, gather_slab_rows (blocks by slot from
several slabs, summed on the way) against the rows it should read and block_sums_ref (CPU under TRITON_INTERPRET=1;
pinned host -> GPU on CUDA)."""

from __future__ import annotations

import pytest
import torch

from tiers.block_checksum import block_sums_ref
from tiers.fetch_kernel import (add_slab, gather_rows, gather_rows_ref, gather_slab_rows, gather_slab_rows_ref,
                                slab_table)

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("num_rows, words, picks", [(5, 7, [4, 0, 4]), (40, 3000, list(range(39, -1, -3))), (9, 4096, [8])])
def test_matches_index_select(num_rows, words, picks):
    src = torch.randint(-2**31, 2**31 - 1, (num_rows, words), dtype=torch.int32)
    device = "cuda" if CUDA else "cpu"
    if CUDA:
        src = src.pin_memory()
    rows = torch.tensor(picks, dtype=torch.int64, device=device)
    got = torch.full((len(picks), words), 7, dtype=torch.int32, device=device)
    gather_rows(src, rows, got)
    want = torch.empty_like(got)
    gather_rows_ref(src, rows, want)
    assert torch.equal(got.cpu(), want.cpu())


def test_bad_arguments_are_named():
    src = torch.zeros((4, 8), dtype=torch.int32)
    with pytest.raises(ValueError, match="src"):
        gather_rows(src.float(), torch.zeros(1, dtype=torch.int64), torch.zeros((1, 8), dtype=torch.int32))
    with pytest.raises(ValueError, match="dst"):
        gather_rows(src, torch.zeros(2, dtype=torch.int64), torch.zeros((1, 8), dtype=torch.int32))


# -- gather_slab_rows: blocks by slot from several slabs, every field in one launch, summed on the way ---------

DEVICE = "cuda" if CUDA else "cpu"


def make_slabs(num_slabs: int, slab_rows: int, words: list[int], seed: int) -> list[list[torch.Tensor]]:
    """Random int32 slabs (pinned on CUDA, where the GPU reads them over PCIe), one tensor per field."""
    g = torch.Generator().manual_seed(seed)
    slabs = [[torch.randint(-2**31, 2**31, (slab_rows, w), generator=g, dtype=torch.int64).to(torch.int32)
              for w in words] for _ in range(num_slabs)]
    return [[f.pin_memory() for f in slab] for slab in slabs] if CUDA else slabs


@pytest.mark.parametrize("words, num_slabs, slab_rows, slots, places", [
    ([4099], 3, 4, [9, 0, 4, 11, 5], None),  # fp16-like: 3 programs a block, the last one partly masked
    ([7], 1, 3, [2], None),  # one block, one short program
    ([2048], 2, 2, [3, 0], [4, 1]),  # exactly one program a block; scattered into a larger batch
    ([2 * 2048 + 3, 5, 2050], 3, 5, [14, 0, 7, 3, 9, 10], None),  # int8-like: data, k_scale, v_scale
    ([12, 2049, 3], 2, 3, [5, 1], [0, 3]),  # a short first field, the middle one over 2 programs; scattered
])
def test_slab_gather_sums_match_block_sums(words, num_slabs, slab_rows, slots, places):
    slabs = make_slabs(num_slabs, slab_rows, words, seed=sum(words) + len(slots))
    table = slab_table(slabs, DEVICE)
    batch = len(slots) if places is None else max(places) + 2
    dsts = [torch.full((batch, w), 7, dtype=torch.int32, device=DEVICE) for w in words]
    start = torch.randint(-2**62, 2**62, (len(slots), 2), generator=torch.Generator().manual_seed(9))
    sums = start.to(DEVICE, copy=True)  # the kernel adds into sums (mod 2^64)
    index = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    dst_rows = None if places is None else torch.tensor(places, dtype=torch.int64, device=DEVICE)
    gather_slab_rows(table, index, dsts, sums, dst_rows)
    rows = [torch.stack([slabs[s // slab_rows][f][s % slab_rows] for s in slots]) for f in range(len(words))]
    at = list(range(len(slots))) if places is None else places
    for dst, want in zip(dsts, rows):
        assert torch.equal(dst.cpu()[at], want)  # bytes exactly as stored
        assert bool((dst.cpu()[[i for i in range(batch) if i not in at]] == 7).all())  # nothing else written
    assert torch.equal(sums.cpu(), start + block_sums_ref(rows))  # int64 adds wrap, like the kernel's
    ref_dsts = [torch.full_like(d, 7) for d in dsts]
    ref_sums = start.to(DEVICE, copy=True)
    gather_slab_rows_ref(table, index, ref_dsts, ref_sums, dst_rows)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(dsts, ref_dsts)) and torch.equal(sums, ref_sums)


def test_slab_gather_without_sums_and_empty_batches():
    slabs = make_slabs(2, 3, [9, 2], seed=4)
    table = slab_table(slabs, DEVICE)
    dsts = [torch.zeros((2, w), dtype=torch.int32, device=DEVICE) for w in (9, 2)]
    gather_slab_rows(table, torch.tensor([5, 1], device=DEVICE), dsts)
    assert torch.equal(dsts[0].cpu(), torch.stack([slabs[1][0][2], slabs[0][0][1]]))
    assert torch.equal(dsts[1].cpu(), torch.stack([slabs[1][1][2], slabs[0][1][1]]))
    empty = [torch.zeros((0, w), dtype=torch.int32, device=DEVICE) for w in (9, 2)]
    sums = torch.zeros((0, 2), dtype=torch.int64, device=DEVICE)
    gather_slab_rows(table, torch.zeros(0, dtype=torch.int64, device=DEVICE), empty, sums)


def test_a_slab_added_in_place_is_read_and_the_address_table_stays():
    """add_slab extends a table with room: the same address tensor (a captured graph's reads stay valid), the rows
    of earlier slabs untouched, and a gather over every slab reads the new one's rows."""
    slabs = make_slabs(3, 4, [6, 3], seed=11)
    table = slab_table(slabs[:1], DEVICE, capacity=3)
    addresses, before = table.addresses, table.addresses.clone()
    for slab in slabs[1:]:
        table = add_slab(table, slab)
    assert table.addresses is addresses and torch.equal(table.addresses[:1], before[:1]) and len(table.slabs) == 3
    slots = [11, 0, 5, 8]  # rows of slabs 2, 0, 1 and 2
    dsts = [torch.zeros((len(slots), w), dtype=torch.int32, device=DEVICE) for w in (6, 3)]
    gather_slab_rows(table, torch.tensor(slots, device=DEVICE), dsts)
    for f, dst in enumerate(dsts):
        assert torch.equal(dst.cpu(), torch.stack([slabs[s // 4][f][s % 4] for s in slots]))
    with pytest.raises(ValueError, match="room for 3 slabs"):
        add_slab(table, slabs[0])
    with pytest.raises(ValueError, match=r"slabs\[1\]\[0\]"):
        add_slab(slab_table(slabs[:1], DEVICE, capacity=2), [slabs[0][0][:, :5].contiguous(), slabs[0][1]])


def test_bad_slab_arguments_are_named():
    x = torch.zeros((4, 8), dtype=torch.int32)
    with pytest.raises(ValueError, match="1 to 3"):
        slab_table([[x] * 4], "cpu")
    with pytest.raises(ValueError, match=r"slabs\[1\]\[0\]"):
        slab_table([[x], [x[:, :4].contiguous()]], "cpu")
    with pytest.raises(ValueError, match="aligned"):
        slab_table([[x.view(-1)[1:29].view(4, 7)]], "cpu")
    table = slab_table([[x]], "cpu")
    rows = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="1 fields"):
        gather_slab_rows(table, rows, [torch.zeros((2, 8), dtype=torch.int32)] * 2)
    with pytest.raises(ValueError, match=r"dsts\[0\]"):
        gather_slab_rows(table, rows, [torch.zeros((2, 7), dtype=torch.int32)])
    with pytest.raises(ValueError, match="sums"):
        gather_slab_rows(table, rows, [torch.zeros((2, 8), dtype=torch.int32)], torch.zeros((2, 2), dtype=torch.int32))
    with pytest.raises(ValueError, match="slots"):
        gather_slab_rows(table, rows.int(), [torch.zeros((2, 8), dtype=torch.int32)])
    if CUDA:
        with pytest.raises(ValueError, match="pageable"):
            slab_table([[x]], "cuda")
