"""The contexts benchmarks run end to end on a small context: a save opened by a new process gives the
never-saved sequence's logits bit for bit, forks of a prefix store its blocks once, and the open profile's
regimes build a store Config."""

from __future__ import annotations

import json

from bench_longctx import contexts_bench
from bench_longctx.contexts_store import bench_config
from bench_longctx.open_profile import REGIMES, config, regime_args


def test_a_saved_context_opened_in_a_new_process_decodes_as_never_saved(tmp_path):
    out = tmp_path / "contexts.json"
    contexts_bench.main(["--contexts", "", "--layers", "2", "--open-tokens", "1K", "--fork-tokens", "1K",
                         "--out", str(out)])
    result = json.loads(out.read_text())
    opened, forks = result["new_process"], result["forks"]
    assert opened["token_equal"] and opened["max_abs_logit_diff"] == 0.0
    assert opened["warmed_up_process"]["token_equal"] and opened["warmed_up_process"]["max_abs_logit_diff"] == 0.0
    assert forks["blocks_ratio"] == 1.0 and forks["with_10_forks"]["references"] > forks["prefix_alone"]["stored"]


def test_every_open_profile_regime_builds_a_store_config(tmp_path):
    for regime in REGIMES:
        args = regime_args(regime, str(tmp_path))
        assert config(args).model.num_layers == REGIMES[regime]["layers"]
        assert bench_config(args, args.path).warm_tokens == args.warm_tokens
