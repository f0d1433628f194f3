"""The one-tile walk (one_tile.py) and the one-launch merge (merge.py) against their references, and the
planner's choice between the one-tile and split walks. Cases come from cases.make_case
(poisoned pools and garbage slots past each row's end: a stray read shows up as NaN or a wrong answer)."""

from __future__ import annotations

import pytest
import torch

from kvstore.attention import plan
from kvstore.attention.merge import merge_splits
from kvstore.attention.paged_decode import paged_decode
from kvstore.attention.plan import DecodeGeometry, balanced_splits, decode_config
from kvstore.attention.reference import merge_splits_ref, paged_decode_ref
from tests.kvstore.attention.cases import CASE_KEYS, CASES, DEVICE, make_case

ONE_TILE_CASES = {  # lengths, kv heads, group, head_dim, block_tokens, fraction int8, kwargs
    # the decode step's table in small: fp16 sink and recent blocks around int8 ones, a part-filled tail
    "step_gqa4_d128_bt64": ([16 * 64 - 17], 2, 4, 128, 64, 1.0, {"sinks_recent": (2, 5)}),
    "step_two_rows_tile2": ([9 * 64 + 1, 300], 2, 4, 64, 64, 1.0, {"sinks_recent": (1, 2), "blocks_per_iter": 2}),
    "alternate_tiles_astride": ([150, 97], 2, 2, 32, 16, 0.5, {"blocks_per_iter": 4}),
    "gqa1_one_block_tiles": ([333], 3, 1, 64, 32, 0.4, {"blocks_per_iter": 1}),
    "gqa8_hot_only": ([201], 1, 8, 64, 32, 0.0, {"empty_pool": "warm"}),
    "gqa3_warm_only": ([130, 0], 2, 3, 32, 32, 1.0, {"empty_pool": "hot"}),
    "many_tiles_two_split_chunks": ([47 * 32 - 5], 1, 2, 32, 16, 0.5, {"blocks_per_iter": 2}),
    "mass_in_two_chunks": ([300 * 8 - 3], 1, 2, 32, 8, 0.5, {}),
    "shared_table": ([77, 140], 2, 2, 32, 32, 0.5, {"shared_table": True, "warps": 8}),
}


def _run(lengths, heads, group, head_dim, block_tokens, frac, kwargs, seed) -> None:
    build = {k: v for k, v in kwargs.items() if k in CASE_KEYS}
    run = {k: v for k, v in kwargs.items() if k not in CASE_KEYS and k != "num_splits"}
    if "warps" in run:
        run["num_warps"] = run.pop("warps")
    case = make_case(lengths, heads, group, head_dim, block_tokens, frac, seed=seed, **build)
    out, mass = paged_decode(*case.args(), return_block_mass=True, walk="one_tile", **run)
    ref_out, ref_mass = paged_decode_ref(*case.args(), return_block_mass=True)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=4e-3, rtol=1e-2)
    torch.testing.assert_close(mass, ref_mass, atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("name", sorted(ONE_TILE_CASES))
def test_one_tile_matches_reference(name: str) -> None:
    _run(*ONE_TILE_CASES[name], seed=sum(map(ord, name)))


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_tile_on_every_kernel_case(name: str) -> None:
    _run(*CASES[name], seed=sum(map(ord, name)) + 1)


def test_peaked_scores_merge_across_tiles() -> None:
    """q scaled up: each row's softmax peaks in a few tiles, far from the first split chunk's maximum."""
    case = make_case([47 * 32 - 5], 1, 4, 32, 32, 0.5, seed=3)
    case.q *= 6
    out, mass = paged_decode(*case.args(), return_block_mass=True, walk="one_tile", blocks_per_iter=1)
    ref_out, ref_mass = paged_decode_ref(*case.args(), return_block_mass=True)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=4e-3, rtol=1e-2)
    torch.testing.assert_close(mass, ref_mass, atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("num_splits, group, max_blocks",
                         [(5, 4, 7), (70, 2, 300), (33, 1, 1), (200, 4, 40), (300, 2, 9)])
def test_merge_matches_reference(num_splits: int, group: int, max_blocks: int) -> None:
    """Random partials with empty splits (-inf), lse spread over 2^±60, a row with no tokens; split counts in one
    step of the merge and in several (200: two steps of 128; 300: three)."""
    gen = torch.Generator().manual_seed(num_splits)
    batch, heads, block_tokens, head_dim = 2, 3, 16, 32
    nq = heads * group
    o_part = torch.randn((batch, nq, num_splits, head_dim), generator=gen)
    lse_part = torch.randn((batch, nq, num_splits), generator=gen) * 20
    lse_part[torch.rand(lse_part.shape, generator=gen) < 0.3] = float("-inf")
    lse_part[:, 0, 0] += 60
    lse_block = torch.randn((batch, nq, max_blocks), generator=gen) * 4 - 3
    num_tokens = torch.tensor([max_blocks * block_tokens - 3, 0], dtype=torch.int32)
    lse_part[1] = float("-inf")  # the empty row's splits
    geom = DecodeGeometry(batch, nq, heads, head_dim, block_tokens, max_blocks)
    args = [t.to(DEVICE) for t in (o_part, lse_part, lse_block, num_tokens)]
    out, mass = merge_splits(*args, geom, True)
    ref_out, ref_mass = merge_splits_ref(*args, block_tokens, heads)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(mass, ref_mass, atol=1e-6, rtol=1e-4)
    assert torch.all(out[1] == 0) and torch.all(mass[1] == 0)
    out_only, no_mass = merge_splits(*args, geom, False)
    assert no_mass is None and torch.equal(out_only, out)


def test_planner_takes_one_tile_for_a_budget_and_splits_for_long_tables(monkeypatch) -> None:
    monkeypatch.setattr(plan, "_sm_count", lambda device: 132)  # the H200
    cuda = torch.device("cuda")
    budget = decode_config(DecodeGeometry(1, 32, 8, 128, 64, 64), cuda)  # llama3-8b, 4096 tokens
    assert budget.one_tile and budget.num_splits * budget.blocks_per_iter == 64
    dense_8k = decode_config(DecodeGeometry(1, 32, 8, 128, 64, 128), cuda)
    assert dense_8k.one_tile
    long = decode_config(DecodeGeometry(1, 32, 8, 128, 64, 16384), cuda)  # 1M tokens
    assert not long.one_tile and long.num_splits > 1 and long.blocks_per_split > long.blocks_per_iter
    assert long.num_splits * 8 % 132 == 0  # every SM runs as many programs (plan.balanced_splits)
    forced = decode_config(DecodeGeometry(1, 32, 8, 128, 64, 64), cuda, num_splits=4)
    assert not forced.one_tile and forced.num_splits == 4
    with pytest.raises(ValueError, match="one split per tile"):
        decode_config(DecodeGeometry(1, 32, 8, 128, 64, 64), cuda, num_splits=4, one_tile=True)


def test_one_tile_caps_rows_at_the_table() -> None:
    """num_tokens past the table's end: the table's blocks, all of them full (as the split walk reads them)."""
    case = make_case([3 * 16], 2, 2, 32, 16, 0.5, seed=5, pad_blocks=0)
    args = list(case.args())
    out, mass = paged_decode(*args, return_block_mass=True, walk="one_tile")
    args[7] = torch.full_like(case.num_tokens, 1000)
    long_out, long_mass = paged_decode(*args, return_block_mass=True, walk="one_tile")
    ref_out, ref_mass = paged_decode_ref(*case.args(), return_block_mass=True)
    torch.testing.assert_close(long_out, out, atol=0, rtol=0)
    torch.testing.assert_close(long_mass, mass, atol=0, rtol=0)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=4e-3, rtol=1e-2)
    torch.testing.assert_close(mass, ref_mass, atol=1e-3, rtol=1e-2)


def test_balanced_split_counts_fill_every_sm_evenly() -> None:
    """llama3-8b at batch 1 on 132 SMs: 8 kv heads x splits programs, a multiple of the SMs (the old 3 per SM
    gave 400 programs: 4 SMs ran a fourth program while the rest idled); a cap on splits is kept."""
    assert [balanced_splits(8, 132, per_sm, 4096) for per_sm in (2, 4)] == [33, 66]
    assert balanced_splits(3, 132, 4, 4096) * 3 % 132 == 0  # SmolLM2's 3 kv heads
    assert balanced_splits(8, 132, 4, 10) == 10
