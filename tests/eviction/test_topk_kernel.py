"""The threshold top-k kernel against its torch reference (CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from eviction.topk_kernel import (_winners, topk_block_table, topk_gather_table, topk_sorted, topk_sorted_ref,
                                  two_stage)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows, n, k", [(1, 1, 1), (3, 37, 5), (8, 200, 64), (2, 1000, 999), (4, 1500, 1), (8, 4097, 128)])
def test_matches_reference_on_random_scores(rows, n, k):
    g = torch.Generator().manual_seed(n * 31 + k)
    scores = (torch.randn((rows, n), generator=g) * torch.rand((rows, 1), generator=g) * 100).to(DEVICE)
    assert torch.equal(topk_sorted(scores, k).cpu(), topk_sorted_ref(scores, k).cpu())


def test_ties_inf_nan_and_negative_zero():
    scores = torch.tensor([[1.0, float("inf"), 1.0, -0.0, 0.0, float("nan"), 1.0, float("inf"), -5.0, 1.0]])
    got = topk_sorted(scores.to(DEVICE), 4).cpu()
    assert got.tolist() == [[0, 1, 2, 7]]  # both +inf, then the first tied 1.0s by index
    assert torch.equal(got, topk_sorted_ref(scores, 4))


def test_fp16_scores_and_strided_rows():
    g = torch.Generator().manual_seed(7)
    base = torch.randn((6, 300), generator=g).to(DEVICE)
    view = base[::2, :257]  # strided rows
    assert torch.equal(topk_sorted(view, 40).cpu(), topk_sorted_ref(view, 40).cpu())
    half = base.half()
    assert torch.equal(topk_sorted(half, 17).cpu(), topk_sorted_ref(half, 17).cpu())


def test_bad_arguments():
    with pytest.raises(ValueError, match="k must be"):
        topk_sorted(torch.randn(2, 5, device=DEVICE), 6)
    with pytest.raises(ValueError, match="float"):
        topk_sorted(torch.ones(2, 5, dtype=torch.int64, device=DEVICE), 2)


@pytest.mark.parametrize("rows, n, k", [(2, 2049, 1), (3, 5000, 64), (8, 17000, 64), (1, 9999, 256), (2, 3073, 200)])
def test_two_stage_matches_reference(rows, n, k):
    """Rows longer than two chunks go through per-chunk candidates; the result is the same."""
    assert two_stage(n, k)
    g = torch.Generator().manual_seed(n + k)
    scores = torch.randn((rows, n), generator=g)
    scores[:, ::7] = scores[:, 3:4]  # ties across chunks
    scores[0, n - 5:] = float("inf")  # winners in the padded last chunk
    scores[-1, :100] = float("-inf")
    scores = scores.to(DEVICE)
    assert torch.equal(topk_sorted(scores, k).cpu(), topk_sorted_ref(scores, k).cpu())


def test_threshold_search_finds_the_kth_key_across_every_bit():
    """Scores that agree in their top bits and differ only in the lowest (and negatives, zeros, infinities):
    the threshold search must resolve every bit."""
    base = torch.tensor([1.0, 1.0000001, 1.0000002, -1.0, -1.0000001, 0.0, -0.0, 3e38, -3e38, float("inf"),
                         float("-inf"), 1e-30, -1e-30, 2.0, 1.5, 1.25])
    scores = base.repeat(3, 9)[:, :130]
    scores[1] = scores[1].flip(0)
    scores[2, 5:40] = 1.0000001  # a long tie at the threshold
    for k in (1, 2, 3, 7, 16, 64, 129, 130):
        got = topk_sorted(scores.to(DEVICE), k).cpu()
        assert torch.equal(got, topk_sorted_ref(scores, k)), k


@triton.jit
def _winners_kernel(key_ptr, k, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _winners(tl.load(key_ptr + offs), k).to(tl.int8))


def test_winners_find_the_kth_key_across_every_bit():
    """The k-th key decided from the top bit down: keys that agree in all but their lowest bits, the extremes
    of the int32 range, negatives, long ties."""
    g = torch.Generator().manual_seed(1)
    keys = torch.cat([torch.tensor([2**31 - 1, -2**31 + 1, 0, -1, 1, 5, 5, 5, 4, 6], dtype=torch.int32),
                      torch.randint(-2**31 + 1, 2**31 - 1, (54,), generator=g, dtype=torch.int32),
                      torch.full((64,), 1000, dtype=torch.int32) + torch.randint(0, 3, (64,), generator=g,
                                                                                  dtype=torch.int32)])
    out = torch.empty(128, dtype=torch.int8, device=DEVICE)
    for k in (1, 2, 3, 9, 40, 64, 100, 127, 128):
        _winners_kernel[(1,)](keys.to(DEVICE), k, out, BLOCK=128)
        expected = torch.zeros(128, dtype=torch.int8)
        expected[topk_sorted_ref(keys[None].double(), k)[0]] = 1
        assert torch.equal(out.cpu(), expected), k


def test_fused_block_table_gathers_the_winners():
    g = torch.Generator().manual_seed(3)
    n, k = 4100, 48
    scores = torch.randn((4, n), generator=g).to(DEVICE)
    slot_map = torch.randint(-1, 1 << 20, (n + 64,), generator=g, dtype=torch.int32).to(DEVICE)
    tier_map = torch.randint(-1, 4, (n + 64,), generator=g, dtype=torch.int8).to(DEVICE)
    selected, slots, is_int8 = topk_block_table(scores, k, slot_map, tier_map, int8_tier=1)
    expected = topk_sorted_ref(scores, k)
    assert torch.equal(selected.cpu(), expected.cpu())
    assert torch.equal(slots.cpu(), slot_map[expected].cpu())
    assert torch.equal(is_int8.cpu(), (tier_map[expected] == 1).cpu())
    with pytest.raises(ValueError, match="two-stage"):
        topk_block_table(scores[:, :1000], k, slot_map, tier_map, int8_tier=1)
    with pytest.raises(ValueError, match="int32"):
        topk_block_table(scores, k, slot_map.long(), tier_map, int8_tier=1)


def test_gathered_block_table_of_candidates():
    """topk_gather_table = index.gather(1, topk_sorted(scores, k)) and its block table, in one launch; ties
    broken by the lower position, -inf and NaN last."""
    g = torch.Generator().manual_seed(4)
    rows, n, k = 8, 256, 64
    scores = torch.randn((rows, n), generator=g)
    scores[:, ::9] = float("-inf")
    scores[:, 5] = scores[:, 6] = scores[:, 7] = 3.0  # ties at the top
    scores[0, 10] = float("nan")
    index = torch.sort(torch.stack([torch.randperm(20000, generator=g)[:n] for _ in range(rows)]), dim=1).values
    slot_map = torch.randint(-1, 1 << 20, (20000,), generator=g, dtype=torch.int32)
    tier_map = torch.randint(-1, 4, (20000,), generator=g, dtype=torch.int8)
    dev = [t.to(DEVICE) for t in (scores, index, slot_map, tier_map)]
    selected, slots, is_int8 = topk_gather_table(dev[0], k, dev[1], dev[2], dev[3], int8_tier=1)
    expected = index.gather(1, topk_sorted_ref(scores, k))
    assert torch.equal(selected.cpu(), expected) and bool((expected.diff(dim=1) > 0).all())
    assert torch.equal(slots.cpu(), slot_map[expected]) and torch.equal(is_int8.cpu(), tier_map[expected] == 1)
    with pytest.raises(ValueError, match="int64 index"):
        topk_gather_table(dev[0], k, dev[1].int(), dev[2], dev[3], int8_tier=1)


@pytest.mark.parametrize("n, k", [(3000, 100), (5000, 64), (4100, 256)])
def test_two_stage_ties_at_the_threshold_in_every_chunk(n, k):
    """The k-th score tied in every chunk (and a constant row): the first k tied indices win, as in
    torch's stable order, although each chunk keeps its own first tied ones."""
    scores = torch.randn((3, n), generator=torch.Generator().manual_seed(n))
    scores[0, ::7] = 10.0  # n / 7 > k tied maxima spread over every chunk
    scores[1] = 1.5  # all tied
    scores[2, ::5] = 10.0
    scores[2, 3::11] = 20.0  # fewer than k above, then ties
    assert two_stage(n, k)
    assert torch.equal(topk_sorted(scores.to(DEVICE), k).cpu(), topk_sorted_ref(scores, k))
    assert topk_sorted(scores.to(DEVICE), k).cpu()[1].tolist() == list(range(k))
