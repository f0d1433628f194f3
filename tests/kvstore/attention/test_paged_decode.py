"""paged_decode (Triton) against paged_decode_ref (torch), the reference against dense SDPA, configs and argument
checks. Cases: tests/kvstore/attention/cases.py (poisoned pools: a stray read shows up as NaN or a wrong answer).
On CPU this runs under TRITON_INTERPRET=1 (tests/conftest.py), on a GPU natively.
"""

from __future__ import annotations

import pytest
import torch

from kvstore.attention.paged_decode import paged_decode
from kvstore.attention.reference import paged_decode_ref
from tests.kvstore.attention.cases import CASES, build_case, dense_expected


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_reference(name: str) -> None:
    case, kwargs = build_case(name)
    out, mass = paged_decode(*case.args(), return_block_mass=True, **kwargs)
    ref_out, ref_mass = paged_decode_ref(*case.args(), return_block_mass=True)
    assert out.dtype == torch.float16 and out.shape == case.q.shape
    assert mass.shape == case.table.shape
    torch.testing.assert_close(out.float(), ref_out.float(), atol=4e-3, rtol=1e-2)
    torch.testing.assert_close(mass, ref_mass, atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("name", ["gqa4_mixed", "gqa3_partial", "shared_table_dense_mode", "empty_row", "fp8_mixed",
                                  "int4_split_small_groups"])
def test_reference_matches_dense_sdpa(name: str) -> None:
    case, _ = build_case(name)
    ref_out, ref_mass = paged_decode_ref(*case.args(), return_block_mass=True)
    out, mass = dense_expected(case)
    torch.testing.assert_close(ref_out.float().cpu(), out, atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(ref_mass.cpu(), mass, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("config", [{"blocks_per_iter": 2}, {"blocks_per_iter": 4, "num_warps": 8},
                                    {"num_splits": 1, "num_stages": 1}, {"num_splits": 9}])
def test_configs_agree(config: dict) -> None:
    case, _ = build_case("gqa4_mixed")
    base, base_mass = paged_decode(*case.args(), return_block_mass=True)
    out, mass = paged_decode(*case.args(), return_block_mass=True, **config)
    torch.testing.assert_close(out.float(), base.float(), atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(mass, base_mass, atol=1e-4, rtol=1e-3)


def test_sm_scale_int8_flags_and_no_mass() -> None:
    case, _ = build_case("gqa3_partial")
    args = list(case.args())
    args[6] = case.is_int8.to(torch.int8)
    out, mass = paged_decode(*args, sm_scale=0.3)
    ref_out, _ = paged_decode_ref(*case.args(), sm_scale=0.3)
    assert mass is None
    torch.testing.assert_close(out.float(), ref_out.float(), atol=4e-3, rtol=1e-2)


@pytest.mark.parametrize("field, bad, message", [
    (0, lambda t: t.float(), "q: expected"),
    (1, lambda t: t[:, :, :1], "hot_pool: expected"),
    (2, lambda t: t.half(), "warm_data: expected"),
    (3, lambda t: t[:, :, :-1], "warm_k_scale: expected"),
    (5, lambda t: t.long(), "block_table: expected"),
    (6, lambda t: t.float(), "block_is_int8: expected"),
    (7, lambda t: t[:1], "num_tokens: expected"),
    (7, lambda t: t.to("meta"), "num_tokens: expected"),
])
def test_bad_arguments_raise_value_error(field: int, bad, message: str) -> None:
    case, _ = build_case("gqa4_mixed")
    args = list(case.args())
    args[field] = bad(args[field])
    for fn in (paged_decode, paged_decode_ref):
        with pytest.raises(ValueError, match=message):
            fn(*args)


def test_group_must_divide_and_config_must_be_valid() -> None:
    case, _ = build_case("gqa3_partial")
    args = list(case.args())
    args[0] = case.q[:, :5]
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_decode(*args)
    with pytest.raises(ValueError, match="blocks_per_iter"):
        paged_decode(*case.args(), blocks_per_iter=3)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode(*case.args(), num_splits=0)
    with pytest.raises(ValueError, match="walk"):
        paged_decode(*case.args(), walk="masked")
    with pytest.raises(ValueError, match="one split per tile"):
        paged_decode(*case.args(), walk="one_tile", num_splits=2)
