"""Preset overrides, the smallest-case reduction and token-count parsing."""

from __future__ import annotations

import pytest

from bench_longctx.presets import PRESETS, get_preset, override, parse_tokens, smallest


@pytest.mark.parametrize("text, want", [("4096", 4096), ("32K", 32768), ("1M", 1 << 20), ("1.5k", 1536), ("0", 0)])
def test_parse_tokens(text, want):
    assert parse_tokens(text) == want


@pytest.mark.parametrize("text", ["", "abc", "1.3", "-4K", "2G"])
def test_parse_tokens_refuses_what_is_not_a_count(text):
    with pytest.raises(ValueError, match="expected"):
        parse_tokens(text)


def test_override_replaces_one_field_by_its_type():
    p = get_preset("quick")
    q = override(p, "decode.contexts=4K,12K")
    assert q.decode.contexts == (4096, 12288) and q.needle == p.needle
    assert override(p, "passkey.depths=0.3").passkey.depths == (0.3,)
    assert override(p, "e2e.context=1M").e2e.context == 1 << 20
    assert override(p, "e2e.fill=random").e2e.fill == "random"
    assert override(p, "tiers.service_sizes=").tiers.service_sizes == ()
    assert override(p, "repeat=7").repeat == 7
    assert override(p, "serve.warm_format=int4").serve.warm_format == "int4"
    assert p.decode.contexts == (4096, 8192, 16384, 32768)  # presets are frozen: the original is unchanged


@pytest.mark.parametrize("bad, match", [("decode.contexts", "SECTION.FIELD=VALUE"), ("nope.x=1", "SECTION"),
                                         ("decode.nope=1", "unknown field"), ("e2e.context=lots", "expected"),
                                         ("e2e.warm_format=int3", "warm_format must be one of")])
def test_override_names_what_it_expected(bad, match):
    with pytest.raises(ValueError, match=match):
        override(get_preset("quick"), bad)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="quick"):
        get_preset("h100")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_smallest_keeps_the_first_case_of_every_list(name):
    p = PRESETS[name]
    s = smallest(p)
    assert s.decode.contexts == p.decode.contexts[:1] and s.needle.budgets == p.needle.budgets[:1]
    assert s.passkey.depths == p.passkey.depths[:1] and s.needle.needles == 1
    assert s.e2e.context == p.e2e.context and s.e2e.steps <= p.e2e.steps


def test_quality_and_passkey_take_several_recent_windows_and_the_sparse_modes_to_run():
    p = get_preset("quick")
    q = override(override(p, "quality.recent_tokens=1024,64"), "quality.modes=topk,sketch,cascade")
    assert q.quality.recent_tokens == (1024, 64) and q.quality.modes == "topk,sketch,cascade"
    assert override(p, "passkey.recent_tokens=64").passkey.recent_tokens == (64,)
    assert smallest(q).quality.modes == "topk,sketch,cascade"  # modes are not a size: --smallest keeps them all


@pytest.mark.parametrize("bad, match", [("quality.modes=topk,dense", "distinct modes"),
                                         ("passkey.modes=quest", "distinct modes"),
                                         ("quality.modes=topk,topk", "distinct modes"),
                                         ("passkey.recent_tokens=", "at least one window")])
def test_modes_and_windows_are_checked(bad, match):
    with pytest.raises(ValueError, match=match):
        override(get_preset("quick"), bad)
