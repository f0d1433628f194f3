"""Both pools present (what the captured decode step always passes): every walk of
paged_decode against the reference over irregular geometries and table mixes, and the partitioned
table (partition.py) against its reference. Cases come from cases.make_case (poisoned
pools: a stray read shows up as NaN or a wrong answer)."""

from __future__ import annotations

import functools

import pytest
import torch

from kvstore.attention.paged_decode import WALKS, paged_decode
from kvstore.attention import partition
from kvstore.attention.partition import PARTITION_CHUNK, partition_table, partition_table_ref
from kvstore.attention.reference import paged_decode_ref
from tests.kvstore.attention.cases import CASE_KEYS, DEVICE, Case, build_case, make_case

VARIANT_CASES = {  # both pools present; lengths, kv heads, group, head_dim, block_tokens, fraction int8, kwargs
    "gqa1_d64_bt16_mixed": ([150, 37], 2, 1, 64, 16, 0.5, {}),
    "gqa4_d128_bt32_sinks_recent": ([333], 2, 4, 128, 32, 1.0, {"sinks_recent": (1, 3)}),
    "gqa8_d128_bt64_mixed_tail": ([200, 64], 1, 8, 128, 64, 0.5, {"num_splits": 2}),
    "gqa4_d64_bt64_all_int8": ([190], 2, 4, 64, 64, 1.0, {}),
    "gqa4_d64_bt32_all_fp16": ([97, 0], 2, 4, 64, 32, 0.0, {}),
    "gqa2_d64_bt16_shared_many_splits": ([260, 31], 2, 2, 64, 16, 0.6, {"shared_table": True, "num_splits": 7}),
    # a few int8 blocks among many fp16 ones (a row may have none), and the other way round
    "gqa4_d64_bt16_few_cooled": ([2000, 700, 0], 2, 4, 64, 16, 0.03, {"num_splits": 7}),
    "gqa2_d128_bt32_few_hot": ([1500], 2, 2, 128, 32, 0.97, {"num_splits": 5}),
}


def _build_variant(name: str) -> tuple[Case, dict]:
    lengths, heads, group, head_dim, block_tokens, frac, kwargs = VARIANT_CASES[name]
    build = {k: v for k, v in kwargs.items() if k in CASE_KEYS}
    run = {k: v for k, v in kwargs.items() if k not in CASE_KEYS}
    return make_case(lengths, heads, group, head_dim, block_tokens, frac, seed=len(name), **build), run


@pytest.mark.parametrize("walk", WALKS)
@pytest.mark.parametrize("name", sorted(VARIANT_CASES))
def test_both_pool_walks_match_reference(name: str, walk: str) -> None:
    case, kwargs = _build_variant(name)
    assert len(case.hot) > 0 and len(case.warm_data) > 0  # the two-pool path, as the decode step calls it
    if walk == "one_tile":
        kwargs.pop("num_splits", None)  # one split per tile
    out, mass = paged_decode(*case.args(), return_block_mass=True, walk=walk, **kwargs)
    ref_out, ref_mass = paged_decode_ref(*case.args(), return_block_mass=True)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=4e-3, rtol=1e-2)
    torch.testing.assert_close(mass, ref_mass, atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("chunk, prefix", [(PARTITION_CHUNK, 1024), (4, 1024), (2, 2)],
                         ids=["one_chunk", "chunks_of_4", "chunks_of_2_prefix_2"])
@pytest.mark.parametrize("name", ["gqa4_mixed", "shared_table_dense_mode", "empty_row", "all_int8_hot_present"])
def test_partition_matches_reference(name: str, chunk: int, prefix: int, monkeypatch) -> None:
    """One program per row (a table of one chunk), and a program per chunk (counts, then the scatter; a prefix
    step smaller than the chunk count walks the earlier counts in several steps)."""
    monkeypatch.setattr(partition, "_PREFIX", prefix)
    case, _ = build_case(name)
    block_tokens = case.hot.shape[3]
    flags = case.is_int8.view(torch.int8)
    assert chunk == PARTITION_CHUNK or case.table.shape[2] > chunk  # several chunks when asked
    part = partition_table(case.table, flags, case.num_tokens, block_tokens, chunk=chunk)
    assert part.slots.shape == case.table.shape and part.num_fp16.shape == case.table.shape[:2]
    for b, row in enumerate(partition_table_ref(case.table, flags, case.num_tokens, block_tokens)):
        for h, (num_fp16, slots, positions) in enumerate(row):
            n = len(slots)
            assert int(part.num_fp16[b, h]) == num_fp16
            assert torch.equal(part.slots[b, h, :n].cpu(), slots)
            assert torch.equal(part.positions[b, h, :n].cpu(), positions)


def test_partition_caps_rows_at_the_table() -> None:
    """num_tokens past the table's end: only the table's entries are partitioned (as the kernel reads them)."""
    table = torch.arange(6, dtype=torch.int32, device=DEVICE).view(1, 1, 6)
    flags = torch.tensor([[[1, 0, 1, 0, 0, 1]]], dtype=torch.int8, device=DEVICE)
    part = partition_table(table, flags, torch.tensor([1000], dtype=torch.int32, device=DEVICE), 16)
    assert int(part.num_fp16[0, 0]) == 3
    assert part.positions[0, 0].tolist() == [1, 3, 4, 5, 2, 0]


def test_walks_match_reference_with_a_chunked_partition(monkeypatch) -> None:
    """paged_decode's partition walk over a table partitioned a program per chunk (as a 1M-token table is)."""
    monkeypatch.setattr(partition, "partition_table", functools.partial(partition_table, chunk=4))
    case, kwargs = _build_variant("gqa2_d64_bt16_shared_many_splits")
    out, mass = paged_decode(*case.args(), return_block_mass=True, walk="partition", **kwargs)
    ref_out, ref_mass = paged_decode_ref(*case.args(), return_block_mass=True)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=4e-3, rtol=1e-2)
    torch.testing.assert_close(mass, ref_mass, atol=1e-3, rtol=1e-2)


def test_a_partition_written_into_given_buffers_is_the_one_made_fresh_and_the_walk_reads_it() -> None:
    """partition_table(out=...) writes the caller's buffers (what a decode step keeps between tokens); paged_decode
    given that partition returns what it returns partitioning the table itself; a wrong out or partition raises."""
    case, kwargs = _build_variant("gqa2_d64_bt16_shared_many_splits")
    block_tokens, (batch, _, m) = case.hot.shape[3], case.table.shape
    flags = case.is_int8.view(torch.int8)
    fresh = partition_table(case.table, flags, case.num_tokens, block_tokens)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    out = (torch.full((batch, 1, m), -7, **i32), torch.full((batch, 1, m), -7, **i32), torch.zeros((batch, 1), **i32))
    kept = partition_table(case.table, flags, case.num_tokens, block_tokens, out=out)
    assert kept.slots.data_ptr() == out[0].data_ptr() and kept.num_fp16.data_ptr() == out[2].data_ptr()
    for b in range(batch):  # entries past a row's blocks are undefined: compare the used ones
        n = -(-int(case.num_tokens[b]) // block_tokens)
        assert torch.equal(kept.slots[b, :, :n], fresh.slots[b, :, :n])
        assert torch.equal(kept.positions[b, :, :n], fresh.positions[b, :, :n])
    assert torch.equal(kept.num_fp16, fresh.num_fp16)
    want = paged_decode(*case.args(), return_block_mass=True, walk="partition", **kwargs)
    got = paged_decode(*case.args(), return_block_mass=True, walk="partition", partition=kept, **kwargs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="out"):
        partition_table(case.table, flags, case.num_tokens, block_tokens, out=(out[0][:, :, :-1], *out[1:]))
    with pytest.raises(ValueError, match="partition"):
        other = partition_table(case.table[:, :, :-1], flags[:, :, :-1], case.num_tokens, block_tokens)
        paged_decode(*case.args(), walk="partition", partition=other, **kwargs)
