"""What the merge (merge.py) hands back besides the output, on every walk, kernel and reference alike: block
mass (summing to one per row), block mass added into a score table where the table's entries came from (the
decode step's H2O account), and each q head's log-sum-exp (the certified omitted mass needs it). Cases:
tests/kvstore/attention/cases.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvstore.attention.paged_decode import paged_decode
from kvstore.attention.plan import check_decode_inputs, decode_config
from kvstore.attention.reference import paged_decode_ref
from tests.kvstore.attention.cases import DEVICE, build_case, dense_lse, make_case


def test_block_mass_sums_to_one_per_row_and_zero_on_padding() -> None:
    case, _ = build_case("gqa4_mixed")
    _, mass = paged_decode(*case.args(), return_block_mass=True)
    n_blocks = (case.num_tokens + 15) // 16
    torch.testing.assert_close(mass.sum(-1), torch.ones_like(mass[..., 0]), atol=1e-4, rtol=0)
    padding = torch.arange(mass.shape[-1], device=DEVICE)[None, None, :] >= n_blocks[:, None, None]
    assert torch.all(mass[padding.expand_as(mass)] == 0)
    assert torch.all(mass[~padding.expand_as(mass)] > 0)


@pytest.mark.parametrize("walk", ["one_tile", "partition"])
@pytest.mark.parametrize("name", ["gqa8_d128", "block_tokens_128", "hot_pool_empty"])
def test_mass_added_into_scores_where_the_table_came_from(name: str, walk: str) -> None:
    """add_mass_to (the decode step's H2O account, in the merge): scores[h, index[h, j]] += mass[h, j] for live
    j, the rest untouched; kernel and reference alike."""
    case, kwargs = build_case(name)
    case = replace(case, num_tokens=case.num_tokens[:1])  # batch 1: one row of each table
    args = list(case.args())
    args[0], args[5], args[6] = args[0][:1], args[5][:1], args[6][:1]
    heads, max_blocks = args[5].shape[1:]
    gen = torch.Generator().manual_seed(3)
    index = torch.stack([torch.randperm(3 * max_blocks, generator=gen)[:max_blocks] for _ in range(heads)])
    scores0 = torch.rand((heads, 3 * max_blocks), generator=gen)
    _, mass = paged_decode_ref(*args, return_block_mass=True)
    n_blocks = -(-int(case.num_tokens[0]) // case.hot.shape[3])
    expected = scores0.clone()
    expected.scatter_add_(1, index[:, :n_blocks], mass[0, :, :n_blocks].cpu())
    run = {k: v for k, v in kwargs.items() if walk == "partition" or k != "num_splits"}
    for fn, extra in ((paged_decode, {"walk": walk, **run}), (paged_decode_ref, {})):
        scores = scores0.clone().to(DEVICE)
        out, none = fn(*args, add_mass_to=(scores, index.to(DEVICE)), **extra)
        assert none is None
        torch.testing.assert_close(scores.cpu(), expected, atol=1e-4, rtol=1e-3)
    with pytest.raises(ValueError, match="add_mass_to index"):
        paged_decode(*args, add_mass_to=(scores, index[:, :-1].to(DEVICE)))


@pytest.mark.parametrize("walk", ["one_tile", "partition", "fused"])
@pytest.mark.parametrize("name", ["gqa4_mixed", "empty_row", "hot_pool_empty", "gqa8_d128"])
def test_lse_out_is_the_log_sum_exp_of_the_attended_logits(name: str, walk: str) -> None:
    """lse_out (what the certified omitted mass needs, from the merge): every walk and the reference give the
    dense log-sum-exp over the row's tokens; outputs unchanged."""
    case, kwargs = build_case(name)
    expected = dense_lse(case)
    run = {k: v for k, v in kwargs.items() if walk != "one_tile" or k != "num_splits"}
    plain, _ = paged_decode(*case.args(), walk=walk, **run)
    for fn, extra in ((paged_decode, {"walk": walk, **run}), (paged_decode_ref, {})):
        lse = torch.zeros(case.q.shape[:2], device=DEVICE)
        out, _ = fn(*case.args(), lse_out=lse, **extra)
        torch.testing.assert_close(lse.cpu(), expected, atol=2e-3, rtol=1e-4)
        if fn is paged_decode:
            assert torch.equal(out, plain)
    with pytest.raises(ValueError, match="lse_out"):
        paged_decode(*case.args(), lse_out=torch.zeros(case.q.shape[:2], dtype=torch.float16, device=DEVICE))


@pytest.mark.parametrize("splits,steps", [(151, 3)])  # one step: every partition-walk test (test_partition.py)
def test_more_splits_than_one_merge_step_holds(splits: int, steps: int) -> None:
    """A partitioned table's 2 x splits partials (302: three 128-wide merge steps, the last partial) merge to
    the reference's output, mass and log-sum-exp."""
    case = make_case([4800, 3000], 2, 4, 64, 16, 0.5, seed=5)
    cfg = decode_config(check_decode_inputs(*case.args()), case.q.device, num_splits=splits, blocks_per_iter=2)
    assert -(-2 * cfg.num_splits // 128) == steps
    lse = torch.zeros(case.q.shape[:2], device=DEVICE)
    out, mass = paged_decode(*case.args(), walk="partition", num_splits=splits, blocks_per_iter=2,
                             return_block_mass=True, lse_out=lse)
    ref_out, ref_mass = paged_decode_ref(*case.args(), return_block_mass=True)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=4e-3, rtol=1e-2)
    torch.testing.assert_close(mass, ref_mass, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(lse.cpu(), dense_lse(case), atol=2e-3, rtol=1e-4)
