"""The kernels over B sequences' tables against their torch references (CPU under TRITON_INTERPRET=1), and
each row against the single-sequence kernels it batches."""

from __future__ import annotations

import pytest
import torch

from eviction.batch_kernels import (add_mass_rows, add_mass_rows_ref, addresses, quest_scores_rows,
                                    quest_scores_rows_ref, topk_table_rows, topk_table_rows_ref)
from eviction.quest_kernel import quest_scores_live
from eviction.topk_kernel import two_stage

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HEADS, GROUP, DIM, BLOCK_TOKENS = 2, 3, 16, 16


def _summaries(capacities: list[int], g: torch.Generator) -> list[torch.Tensor]:
    out = []
    for n in capacities:  # min <= max per channel, as appended keys make them
        a, b = torch.randn((2, n, HEADS, DIM), generator=g)
        out.append(torch.stack([torch.minimum(a, b), torch.maximum(a, b)], 1).half().to(DEVICE))
    return out


@pytest.mark.parametrize("capacities, counts", [([40, 23, 57], [600, 300, 900]), ([9], [100])])
def test_quest_rows_match_reference_and_single_kernel(capacities, counts):
    g = torch.Generator().manual_seed(sum(capacities))
    summaries = _summaries(capacities, g)
    q = torch.randn((len(capacities), HEADS * GROUP, DIM), generator=g).half().to(DEVICE)
    count = torch.tensor(counts, dtype=torch.int64, device=DEVICE)
    width = max(capacities) + 5  # wider than every table: the padding scores -inf
    args = dict(block_tokens=BLOCK_TOKENS, sink_blocks=2, recent_tokens=40)
    got = quest_scores_rows(q, summaries, addresses(summaries, DEVICE), count, width, **args)
    want = quest_scores_rows_ref(q, summaries, count, width, **args)
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got.sign(), want.sign())
    finite = want.isfinite()
    assert finite.sum() > 0 and torch.allclose(got[finite], want[finite], rtol=1e-3, atol=1e-2)
    for i, s in enumerate(summaries):  # each row is what the single-sequence launch gives
        alone = quest_scores_live(q[i], s, count[i: i + 1], **args)
        assert torch.equal(got[i, :, : s.shape[0]], alone)
        assert (got[i, :, s.shape[0]:] == float("-inf")).all()


@pytest.mark.parametrize("n, k", [(70, 9), (3000, 24)])  # one program per row; two stages (chunk candidates)
def test_topk_table_rows_match_reference(n, k):
    assert two_stage(n, k) == (n > 2048)
    g = torch.Generator().manual_seed(n + k)
    b = 3
    scores = torch.randn((b, HEADS, n), generator=g).to(DEVICE)
    scores[:, :, :2] = float("inf")  # protected sinks
    scores[1, :, n - n // 3:] = float("-inf")  # a shorter sequence: blocks past its count
    slot_maps = [torch.randperm(n + i, generator=g).to(torch.int32).to(DEVICE) for i in range(b)]
    tier_maps = [torch.randint(0, 3, (n + i,), generator=g, dtype=torch.int8).to(DEVICE) for i in range(b)]
    got = topk_table_rows(scores, k, addresses(slot_maps, DEVICE), addresses(tier_maps, DEVICE),
                          (slot_maps[0], tier_maps[0]), 1)
    want = topk_table_rows_ref(scores, k, slot_maps, tier_maps, 1)
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    assert got[2].any() and not got[2].all()  # both tiers among the winners: the flags are read, not constant


def test_add_mass_rows_matches_reference():
    g = torch.Generator().manual_seed(5)
    capacities, k = [31, 12, 50], 6
    h2o = [torch.rand((HEADS, n), generator=g).to(DEVICE) for n in capacities]
    want = [t.clone() for t in h2o]
    selected = torch.stack([torch.stack([torch.randperm(n, generator=g)[:k].sort().values for _ in range(HEADS)])
                            for n in capacities]).to(DEVICE)  # [B, H, k] distinct per row
    mass = torch.rand((len(capacities), HEADS, k + 3), generator=g).to(DEVICE)  # the kernel pads its rows
    strides = torch.tensor([t.stride(0) for t in h2o], dtype=torch.int64, device=DEVICE)
    add_mass_rows(mass, selected, addresses(h2o, DEVICE), h2o[0], strides)
    add_mass_rows_ref(mass, selected, want)
    for x, y in zip(h2o, want):
        assert torch.allclose(x, y)
    assert not torch.equal(h2o[0], torch.zeros_like(h2o[0]))


def test_bad_arguments():
    summaries = _summaries([8, 8], torch.Generator().manual_seed(0))
    q = torch.zeros((2, HEADS * GROUP, DIM), dtype=torch.float16, device=DEVICE)
    count = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="summaries of one dtype"):
        quest_scores_rows(q, summaries, addresses(summaries, DEVICE), count, 4, block_tokens=16, sink_blocks=0,
                          recent_tokens=16)  # narrower than a table
    with pytest.raises(ValueError, match="2 rows of q need 2"):
        quest_scores_rows(q, summaries[:1], addresses(summaries, DEVICE), count, 8, block_tokens=16,
                          sink_blocks=0, recent_tokens=16)
    scores = torch.zeros((2, HEADS, 8), device=DEVICE)
    maps = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="k in"):
        topk_table_rows(scores, 9, count, count, (maps, maps.to(torch.int8)), 1)
    with pytest.raises(ValueError, match="int32"):
        topk_table_rows(scores, 2, count, count, (maps.long(), maps.to(torch.int8)), 1)


def test_an_empty_row_reads_and_writes_only_its_scratch_table():
    """A row with no sequence (kvstore/decode/batch_slots.py): count 0, its addresses those of a scratch table (one
    summary entry, slot and tier maps of the full width, H2O scores [H, width]). Every kernel gives the real rows what they
    give without it and touches nothing but the scratch; the empty row selects block 0 (its protected tail) and
    k - 1 blocks of -inf within the width, all mapped to the scratch slot."""
    g = torch.Generator().manual_seed(11)
    capacities, width, k, scratch_slot = [40, 23], 48, 6, 99
    real = _summaries(capacities, g)
    scratch = _summaries([1], g)[0]  # [1, 2, H, D]
    summaries = [real[0], scratch, real[1]]  # row 1 is empty
    q = torch.randn((3, HEADS * GROUP, DIM), generator=g).half().to(DEVICE)
    count = torch.tensor([600, 0, 300], dtype=torch.int64, device=DEVICE)
    args = dict(block_tokens=BLOCK_TOKENS, sink_blocks=2, recent_tokens=40)
    scores = quest_scores_rows(q, summaries, addresses(summaries, DEVICE), count, width, **args)
    assert torch.equal(scores.isinf(), quest_scores_rows_ref(q, summaries, count, width, **args).isinf())
    assert (scores[1, :, 0] == float("inf")).all() and (scores[1, :, 1:] == float("-inf")).all()
    for i in (0, 2):
        assert torch.equal(scores[i], quest_scores_rows(q[i: i + 1], summaries[i: i + 1],
                                                        addresses(summaries[i: i + 1], DEVICE), count[i: i + 1],
                                                        width, **args)[0])
    slot_maps = [torch.randperm(n, generator=g).to(torch.int32).to(DEVICE) for n in capacities]
    tier_maps = [torch.randint(0, 2, (n,), generator=g, dtype=torch.int8).to(DEVICE) for n in capacities]
    slot_maps.insert(1, torch.full((width,), scratch_slot, dtype=torch.int32, device=DEVICE))
    tier_maps.insert(1, torch.zeros(width, dtype=torch.int8, device=DEVICE))
    got = topk_table_rows(scores, k, addresses(slot_maps, DEVICE), addresses(tier_maps, DEVICE),
                          (slot_maps[0], tier_maps[0]), 1)
    for x, y in zip(got, topk_table_rows_ref(scores, k, slot_maps, tier_maps, 1)):
        assert torch.equal(x[[0, 2]], y[[0, 2]])  # the empty row's -inf ties may break either way
    selected, slots, is_int8 = got
    assert (selected[1, :, 0] == 0).all() and int(selected[1].max()) < width and len(set(selected[1, 0].tolist())) == k
    assert (slots[1] == scratch_slot).all() and not is_int8[1].any()
    assert int(selected[0].max()) < capacities[0] and int(selected[2].max()) < capacities[1]
    h2o = [torch.rand((HEADS, n), generator=g).to(DEVICE) for n in capacities]
    h2o.insert(1, torch.zeros((HEADS, width), device=DEVICE))
    want = [t.clone() for t in h2o]
    mass = torch.rand((3, HEADS, k), generator=g).to(DEVICE)
    mass[1] = 0.0  # what the attention kernel gives a row of 0 tokens
    strides = torch.tensor([t.stride(0) for t in h2o], dtype=torch.int64, device=DEVICE)
    add_mass_rows(mass, selected, addresses(h2o, DEVICE), h2o[0], strides)
    add_mass_rows_ref(mass, selected, want)
    assert all(torch.equal(x, y) for x, y in zip(h2o, want)) and not h2o[1].any()
