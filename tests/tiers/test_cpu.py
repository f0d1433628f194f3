"""The cpu tier: checksums on every read (xxh3 on the host; block sums on the checksum device: the kernels under
TRITON_INTERPRET=1 on CPU, the GPU on CUDA), chunked parallel gathers, the host-memory guard."""

from __future__ import annotations

import pytest
import torch

import tiers.cpu
from tiers.base import IntegrityError
from tiers.block_checksum import block_sums_ref
from tiers.cpu import CpuTier
from tiers.layout import BlockLayout, QuantBlocks
from tiers.quant import quantize

CUDA = torch.cuda.is_available()

LAYOUT = BlockLayout(num_kv_heads=2, block_tokens=64, head_dim=64)  # 32 KiB blocks


def blocks(n: int, seed: int) -> torch.Tensor:
    return torch.randn((n, *LAYOUT.shape), generator=torch.Generator().manual_seed(seed)).half()


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_corrupted_host_memory_is_detected(dtype):
    tier = CpuTier(LAYOUT, 64 * LAYOUT.fp16_bytes, dtype=dtype, memory_reserve=0, checksums="host")
    tier.put([1, 2, 3], blocks(3, seed=1))
    slab = tier.slabs[0] if dtype == "float16" else tier.slabs[0].data
    row_bytes = slab[0].numel() * slab.element_size()
    slab.view(torch.uint8).view(-1)[row_bytes + 17] ^= 1  # a bit flip in block 2's slot (slot 1)
    with pytest.raises(IntegrityError, match="block 2"):
        tier.get([1, 2, 3])
    # The GPU fetch path verifies stored rows in place (no gather first): same verdict.
    with pytest.raises(IntegrityError, match="block 2"):
        tier._verify([1, 2, 3], tier.slots.lookup([1, 2, 3]), 0, 3)
    assert tier.integrity_errors == 2
    tier.get([1, 3])  # intact blocks still read
    tier._verify([1, 3], tier.slots.lookup([1, 3]), 0, 2)


def test_large_gathers_run_in_verified_chunks():
    n = 700  # > one 8 MiB chunk of 32 KiB blocks
    tier = CpuTier(LAYOUT, 1024 * LAYOUT.fp16_bytes, memory_reserve=0)
    x = blocks(n, seed=2)
    tier.put(list(range(n)), x)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(3)).tolist()
    assert torch.equal(tier.get(order), x[order])
    assert torch.equal(tier.fetch(order, "cpu"), x[order])
    tier.close()


def test_host_memory_guard_refuses_instead_of_oom():
    huge_reserve = 1 << 60  # more than any machine has: no new slab may be allocated
    tier = CpuTier(LAYOUT, 8 * LAYOUT.fp16_bytes, memory_reserve=huge_reserve)
    assert tier.free_blocks() == 0 and not tier.can_put(1)
    with pytest.raises(MemoryError, match="host memory"):
        tier.put([1], blocks(1, seed=4))
    assert tier.num_blocks == 0


def same(a, b) -> bool:
    if isinstance(a, QuantBlocks):
        return all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a.tensors(), b.tensors()))
    return torch.equal(a.cpu(), b.cpu())


def damage(tier: CpuTier, block_id: int, byte: int) -> None:
    """Flip one bit of the block's pinned (or pageable) slab row, in place."""
    slot = tier.slots.lookup([block_id])[0]
    slab = tier.slabs[slot // tier.slab_blocks]
    field = slab if isinstance(slab, torch.Tensor) else slab.tensors()[byte % 3]
    field[slot % tier.slab_blocks].view(-1).view(torch.uint8)[byte % (field[0].numel() * field.element_size())] ^= 4


SUM_DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_block_sums_across_slabs_verify_every_read(dtype, monkeypatch):
    monkeypatch.setattr(tiers.cpu, "_SLAB_BYTES", 5 * LAYOUT.bytes_for(dtype))  # 5 blocks a slab: 4 slabs
    tier = CpuTier(LAYOUT, 20 * LAYOUT.bytes_for(dtype), dtype=dtype, memory_reserve=0, checksums=SUM_DEVICE)
    x = blocks(18, seed=5)
    from_device = x[:6].to(SUM_DEVICE)  # on CUDA: summed on the GPU before it leaves
    tier.put(list(range(6)), from_device if dtype == "float16" else quantize(from_device))
    tier.put(list(range(6, 18)), x[6:])  # host blocks: summed in their slab rows
    assert len(tier.slabs) == 4
    stored = tier.get(list(range(18)))
    if dtype == "float16":
        want = x
    else:  # quantized where each batch was: a GPU may round a scale differently from the CPU
        parts = quantize(from_device).to("cpu"), quantize(x[6:])
        want = QuantBlocks(*(torch.cat(fields) for fields in zip(*(p.tensors() for p in parts))))
    assert same(stored, want)
    fields = stored.tensors() if dtype == "int8" else (stored,)
    assert torch.equal(tier.sums[torch.tensor(tier.slots.lookup(list(range(18))), device=SUM_DEVICE)].cpu(),
                       block_sums_ref(fields))
    order = [17, 2, 9, 0, 11, 16, 4]  # every slab, out of order
    assert same(tier.fetch(order, SUM_DEVICE), want[order] if dtype == "float16" else want.index(torch.tensor(order)))
    tier.delete([2, 9])
    tier.put([40, 41], x[[0, 1]])  # reused slots get fresh sums (host blocks: quantized on the host)
    assert same(tier.fetch([41, 40], SUM_DEVICE), x[[1, 0]] if dtype == "float16" else quantize(x[[1, 0]]))
    tier.check_integrity()
    tier.close()


@pytest.mark.parametrize("checksums", [SUM_DEVICE, "host"])
@pytest.mark.parametrize("dtype", ["float16", "int8"])
@pytest.mark.parametrize("byte", [0, 4, 1001])  # int8: data, k_scale, v_scale
def test_a_damaged_pinned_row_fails_fetch_and_get_and_serves_nothing(checksums, dtype, byte):
    tier = CpuTier(LAYOUT, 8 * LAYOUT.bytes_for(dtype), dtype=dtype, memory_reserve=0, checksums=checksums)
    x = blocks(4, seed=6)
    tier.put([10, 11, 12, 13], x.to(SUM_DEVICE))
    damage(tier, 12, byte)
    served = []
    for read in (lambda: tier.fetch([13, 12, 10], SUM_DEVICE), lambda: tier.get([12]), lambda: tier.fetch([12], "cpu")):
        with pytest.raises(IntegrityError, match="block 12 failed"):
            served.append(read())
    assert served == [] and tier.integrity_errors == 3
    assert same(tier.fetch([13, 10, 11], SUM_DEVICE), tier.get([13, 10, 11]))  # the others still read
    assert 12 in tier and tier.num_blocks == 4  # kept for the store to decide; never returned as data
    tier.check_integrity()


def test_several_damaged_blocks_are_all_counted_and_named():
    tier = CpuTier(LAYOUT, 8 * LAYOUT.fp16_bytes, memory_reserve=0, checksums=SUM_DEVICE)
    tier.put(list(range(6)), blocks(6, seed=7))
    for block_id in (1, 4):
        damage(tier, block_id, 77)
    with pytest.raises(IntegrityError, match=r"block 4 failed its checksum \(and 1 more: \[1\]\)"):
        tier.fetch([4, 0, 1], SUM_DEVICE)
    assert tier.integrity_errors == 2


def test_checksum_choice():
    auto = CpuTier(LAYOUT, LAYOUT.fp16_bytes)
    assert auto.sum_device == (torch.device("cuda", torch.cuda.current_device()) if CUDA else None)
    assert CpuTier(LAYOUT, LAYOUT.fp16_bytes, checksums="host").sum_device is None
    with pytest.raises(ValueError, match="checksums"):
        CpuTier(LAYOUT, LAYOUT.fp16_bytes, checksums="nonsense")
    with pytest.raises(ValueError, match="pinned"):
        CpuTier(LAYOUT, LAYOUT.fp16_bytes, pin=False, checksums="cuda")


@pytest.mark.parametrize("checksums", ["host", SUM_DEVICE])
def test_empty_get_and_fetch(checksums):
    tier = CpuTier(LAYOUT, 4 * LAYOUT.bytes_for("float16"), memory_reserve=0, checksums=checksums)
    tier.put([1], blocks(1, seed=2))
    assert len(tier.get([])) == 0 and len(tier.fetch([], SUM_DEVICE)) == 0
    tier.check_integrity()


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_fetch_sums_while_it_gathers_across_slabs(dtype, monkeypatch):
    """fetch on the checksum device: one gather that sums on the way (no second read: block_sums is never called),
    over slabs added after an earlier fetch; a flipped bit in any field of a pinned row raises, nothing served."""
    monkeypatch.setattr(tiers.cpu, "_SLAB_BYTES", 3 * LAYOUT.bytes_for(dtype))  # 3 blocks a slab
    tier = CpuTier(LAYOUT, 12 * LAYOUT.bytes_for(dtype), dtype=dtype, memory_reserve=0, checksums=SUM_DEVICE)
    x = blocks(10, seed=8)
    tier.put(list(range(4)), x[:4])
    want = tier.get(list(range(4)))

    def fetch(ids: list[int]):
        with monkeypatch.context() as m:
            m.setattr(tiers.cpu, "block_sums", None)  # a second read of the rows would fail here
            return tier.fetch(ids, SUM_DEVICE)

    assert same(fetch([3, 0, 2]), want.index(torch.tensor([3, 0, 2])) if dtype == "int8" else want[[3, 0, 2]])
    tier.put(list(range(4, 10)), x[4:].to(SUM_DEVICE))  # two more slabs: the slab table is rebuilt
    assert len(tier.slabs) == 4
    order = [9, 1, 6, 3, 0, 8]
    fetched = fetch(order)
    assert same(fetched, tier.get(order))
    for field, block_id in enumerate((8, 6, 1)):  # int8: data, k_scale, v_scale
        damage(tier, block_id, 3 * 1001 + field)
        with pytest.raises(IntegrityError, match=f"block {block_id} failed"):  # the first damaged in `order`
            fetch(order)
    assert tier.integrity_errors == 1 + 2 + 3
    assert same(fetch([9, 0, 3]), fetched.index(torch.tensor([0, 4, 3])) if dtype == "int8" else fetched[[0, 4, 3]])
    tier.check_integrity()


@pytest.mark.parametrize("dtype", ["float16", "int8"])
@pytest.mark.parametrize("seed", range(4))
def test_row_copies_write_what_indexing_writes(dtype, seed):
    """copy_rows (slices per run of rows consecutive on both sides, or fancy indexing when runs are short) against
    torch's indexing: long runs broken on one side only, single rows, scattered rows, every field of the format."""
    from tiers.block_rows import copy_rows, fields

    g = torch.Generator().manual_seed(seed)
    n = 40
    x = blocks(n, seed)
    src = x if dtype == "float16" else quantize(x)
    runs = [(0, 100, 17), (17, 50, 5), (22, 117, 18)] if seed % 2 else [(0, 3, n)]  # (src start, dst start, length)
    src_rows = torch.cat([torch.arange(s, s + k) for s, _, k in runs])
    dst_rows = torch.cat([torch.arange(d, d + k) for _, d, k in runs])
    if seed >= 2:  # scattered: every run a single row
        order = torch.randperm(n, generator=g)
        src_rows, dst_rows = src_rows[order], dst_rows[order]
    got = LAYOUT.empty(dtype, 140, "cpu")
    for f in fields(got):
        f.view(torch.uint8).fill_(0x5A)
    want = [f.clone() for f in fields(got)]
    copy_rows(src, src_rows, got, dst_rows)
    for w, f in zip(want, fields(src)):
        w[dst_rows] = f[src_rows]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(fields(got), want))


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_row_runs_copy_what_row_copies_copy(dtype):
    """copy_row_runs (put's path from a GPU into pinned slabs: one copy per run of rows consecutive on both sides)
    writes what copy_rows writes: runs, single rows, descending rows, a run broken on one side only."""
    from tiers.block_rows import copy_row_runs, copy_rows, fields

    x = blocks(9, 7)
    src = x if dtype == "float16" else quantize(x)
    src_rows = torch.tensor([0, 1, 2, 5, 4, 3, 6, 7, 8])
    dst_rows = torch.tensor([10, 11, 12, 3, 2, 1, 7, 8, 0])  # runs [0-2], single rows, [6-7] then a jump
    empty = lambda *a, **k: LAYOUT.empty(dtype, *a, **k)
    got, want = empty(14, "cpu"), empty(14, "cpu")
    for f, g in zip(fields(got), fields(want)):
        f.view(torch.uint8).fill_(0x5A)
        g.view(torch.uint8).fill_(0x5A)
    copy_row_runs(src, src_rows, got, dst_rows)
    copy_rows(src, src_rows, want, dst_rows)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(fields(got), fields(want)))
    assert bool((fields(got)[0][[4, 5, 6, 9, 13]].view(torch.uint8) == 0x5A).all())  # rows not written stay


def test_slabs_join_the_slab_table_in_place_and_only_checksum_growth_makes_graphs_stale(monkeypatch):
    """A captured step reads the cpu tier through its slab table and per-head sums (graph key: `generation`). A new
    slab is written into the same address table, so the key changes only when the checksum tables reallocate
    (doubling: room for 1, 2, 4, 8, 16 slabs), not at every slab; every block put before or after reads back intact."""
    monkeypatch.setattr(tiers.cpu, "_SLAB_BYTES", 2 * LAYOUT.fp16_bytes)  # 2 blocks a slab
    tier = CpuTier(LAYOUT, 24 * LAYOUT.fp16_bytes, memory_reserve=0, checksums="cpu")
    x = blocks(24, 3)
    tier.put([0, 1], x[:2])
    table = tier.slab_table(torch.device("cpu"))
    generations = [tier.generation]
    for i in range(2, 24, 2):  # one slab at a time
        tier.put([i, i + 1], x[i: i + 2])
        generations.append(tier.generation)
        assert tier.slab_table(torch.device("cpu")).addresses is table.addresses
    assert len(tier.slabs) == 12 and len(set(generations)) == 5  # sums for 1, 2, 4, 8, 16 slabs: 5 keys, not 12
    assert torch.equal(tier.get(list(range(24))), x)
    tier.check_integrity()
