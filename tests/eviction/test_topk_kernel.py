"""The threshold top-k kernel against its torch reference (CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from eviction.topk_kernel import _winners, topk_block_table, topk_sorted, topk_sorted_ref, two_stage

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
def _winners_kernel(key_ptr, k, out_ptr, BLOCK: tl.constexpr, BITS: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _winners(tl.load(key_ptr + offs), k, BITS).to(tl.int8))


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_every_search_width_finds_the_kth_key_across_every_bit(bits):
    """The k-th key decided 1, 2 or 4 bits per pass: keys that agree in all but their lowest bits, the
    extremes of the int32 range, negatives, long ties."""
    g = torch.Generator().manual_seed(bits)
    keys = torch.cat([torch.tensor([2**31 - 1, -2**31 + 1, 0, -1, 1, 5, 5, 5, 4, 6], dtype=torch.int32),
                      torch.randint(-2**31 + 1, 2**31 - 1, (54,), generator=g, dtype=torch.int32),
                      torch.full((64,), 1000, dtype=torch.int32) + torch.randint(0, 3, (64,), generator=g,
                                                                                  dtype=torch.int32)])
    out = torch.empty(128, dtype=torch.int8, device=DEVICE)
    for k in (1, 2, 3, 9, 40, 64, 100, 127, 128):
        _winners_kernel[(1,)](keys.to(DEVICE), k, out, BLOCK=128, BITS=bits)
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


def _live_table(capacity, num_kv_heads, group, head_dim, count, block_tokens, seed, ties):
    """q, summaries [capacity, 2, H, D] (NaN past the live blocks, as unwritten capacity), slot/tier maps."""
    g = torch.Generator().manual_seed(seed)
    live = -(-(count + 1) // block_tokens)
    centre = torch.randn(capacity, 1, num_kv_heads, head_dim, generator=g)
    spread = torch.rand(capacity, 1, num_kv_heads, head_dim, generator=g) + 0.1
    summaries = torch.cat([centre - spread, centre + spread], 1).half()  # [N, 2, H, D]
    if ties:  # every ties-th block one wide box: equal top scores in every head, the k-th among them
        summaries[1:live:ties, 0], summaries[1:live:ties, 1] = -4.0, 4.0
    summaries[live:] = float("nan")
    q = torch.randn(num_kv_heads * group, head_dim, generator=g).half()
    slot_map = torch.randint(-1, 1 << 20, (capacity + 3,), generator=g, dtype=torch.int32)
    tier_map = torch.randint(-1, 4, (capacity + 3,), generator=g, dtype=torch.int8)
    return q.to(DEVICE), summaries.to(DEVICE), slot_map.to(DEVICE), tier_map.to(DEVICE)


@pytest.mark.parametrize("capacity, heads, group, head_dim, k, count, sinks, recent, chunk, block_n, ties", [
    (517, 2, 4, 64, 24, 517 * 16 - 1, 1, 100, 128, 64, 0),  # partial last tile and chunk, full table
    (517, 3, 3, 48, 24, 300 * 16 + 5, 2, 40, 128, 32, 7),  # head_dim padded, dead capacity, ties
    (333, 1, 1, 128, 64, 200 * 16, 0, 0, 64, 16, 2),  # k == chunk, ties every other block
    (333, 2, 2, 64, 1, 40 * 16 + 3, 0, 17, 256, 64, 0),  # k = 1, one live chunk, two dead
    (200, 2, 4, 64, 16, 7, 1, 16, 64, 32, 0),  # fewer live blocks than k: dead blocks fill in
    (200, 2, 4, 64, 16, 150 * 16, 20, 10000, 64, 64, 0),  # every live block protected: +inf ties
])
def test_quest_select_is_quest_scores_then_block_table(capacity, heads, group, head_dim, k, count, sinks, recent,
                                                       chunk, block_n, ties):
    """One launch, Quest scores and both top-k stages folded in: the scores of quest_scores_live (bitwise at its
    own tile, block_n 64) and exactly the block table topk_block_table takes from them."""
    from eviction.quest_kernel import quest_scores_live, quest_scores_live_ref
    from eviction.topk_kernel import QuestSelect

    q, summaries, slot_map, tier_map = _live_table(capacity, heads, group, head_dim, count, 16, capacity + k, ties)
    n = torch.tensor([count], dtype=torch.int64, device=DEVICE)
    kw = dict(block_tokens=16, sink_blocks=sinks, recent_tokens=recent)
    for merge_in_kernel, search_bits in ((True, 1), (False, 2), (True, 4)):
        plan = QuestSelect(capacity, heads, k, DEVICE, chunk=chunk, block_n=block_n, merge_in_kernel=merge_in_kernel,
                           search_bits=search_bits)
        for _ in range(2):  # the workspace is as the next launch expects it
            selected, slots, is_int8, scores = plan(q, summaries, n, slot_map, tier_map, 1, **kw)
            plan.check_integrity()
        want = quest_scores_live_ref(q, summaries, n, **kw)
        assert torch.equal(torch.isinf(scores), torch.isinf(want)) and torch.equal(scores > 0, want > 0)
        torch.testing.assert_close(scores, want, rtol=1e-3, atol=1e-2)
        if block_n == 64:
            assert torch.equal(scores, quest_scores_live(q, summaries, n, **kw))
        expected = topk_sorted_ref(scores, k)
        assert torch.equal(selected.cpu(), expected.cpu())
        assert torch.equal(slots.cpu(), slot_map[expected].cpu())
        assert torch.equal(is_int8.cpu(), (tier_map[expected] == 1).cpu())


def test_quest_select_rejects_bad_settings_and_inputs():
    from eviction.topk_kernel import QuestSelect

    with pytest.raises(ValueError, match="block_n"):
        QuestSelect(300, 2, 8, DEVICE, chunk=96, block_n=64)
    with pytest.raises(ValueError, match="k in"):
        QuestSelect(300, 2, 65, DEVICE, chunk=64, block_n=16)
    q, summaries, slot_map, tier_map = _live_table(300, 2, 4, 64, 1000, 16, 0, 0)
    plan = QuestSelect(300, 2, 8, DEVICE, chunk=64, block_n=16)
    n = torch.tensor([1000], dtype=torch.int64, device=DEVICE)
    kw = dict(block_tokens=16, sink_blocks=1, recent_tokens=32)
    with pytest.raises(ValueError, match="capacity"):
        plan(q, summaries[:299], n, slot_map, tier_map, 1, **kw)
    with pytest.raises(ValueError, match="count"):
        plan(q, summaries, n.int(), slot_map, tier_map, 1, **kw)
    with pytest.raises(ValueError, match="slot_map"):
        plan(q, summaries, n, slot_map[:200], tier_map, 1, **kw)
