"""Pieces of the suites that the end-to-end run cannot pin down: the whole-model static step against
store.attend, the needle construction, the skip paths, and bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench_longctx.e2e import model_args, random_model
from bench_longctx.models import model_store
from bench_longctx.needle import needle_keys, needle_queries
from engine_adapter.static_step import StaticStep
from engine_adapter import weights
from engine_adapter.llama import Decoder
from kvstore.cli import main
from kvstore.config import ModelSpec


def reference_step(model, store, seq: int, token: int, mode: str, budget: int) -> torch.Tensor:
    """One step of the model at the sequence's next position, attending through store.attend without appending."""
    pos = store.table(seq, 0).num_tokens
    cos, sin = model.rope(torch.tensor([pos]), torch.float32)
    x = model.embed_tokens(torch.tensor([token]))
    for i, layer in enumerate(model.layers):
        q, _, _ = layer.qkv(x, cos, sin)
        x = layer.finish(x, store.attend(seq, i, q[0].half(), mode=mode, budget=budget)[None])
    return model.logits(x)[0]


@pytest.mark.parametrize("mode", ["dense", "topk"])
def test_static_step_matches_store_attend(mode):
    args = model_args("smollm2-135m", layers=2)
    model = random_model(args, torch.device("cpu"), torch.float32, seed=3)
    store = model_store(args.spec, torch.device("cpu"), hot_tokens=96, warm_tokens=2048, sink_tokens=32,
                        recent_tokens=64, sequences=1)
    seq = store.create_sequence()
    with torch.inference_mode():
        Decoder(model, store).prefill(seq, torch.randint(0, args.vocab_size, (777,)), chunk_tokens=256)
        assert store.stats()["tiers"]["warm"]["blocks"] > 0  # the step reads fp16 and int8 blocks
        step = StaticStep(model, store, seq, mode, budget=256)
        got = step.logits_for(17)
        want = reference_step(model, store, seq, 17, mode, 256)
        assert torch.allclose(got, want, atol=1e-3, rtol=1e-3)
        tokens = step.run(3, 17)
        assert tokens[0] == int(want.argmax()) and len(tokens) == 3
        assert tokens[1] == int(reference_step(model, store, seq, tokens[0], mode, 256).argmax())
    store.close()


def test_static_step_refuses_a_bad_mode():
    args = model_args("smollm2-135m", layers=1)
    store = model_store(args.spec, torch.device("cpu"), hot_tokens=64, warm_tokens=0, sink_tokens=32,
                        recent_tokens=32, sequences=1)
    with pytest.raises(ValueError, match="mode must be one of"):
        StaticStep(random_model(args, torch.device("cpu"), torch.float32), store, store.create_sequence(), "h2o")
    store.close()


@pytest.mark.parametrize("geometry, ctx", [("smollm2-135m", 5000), ("llama3-8b", 1 << 20)])
def test_needle_logit_clears_the_distractors_for_every_head(geometry, ctx):
    spec = ModelSpec.preset(geometry, num_layers=1)
    q = needle_queries(spec, 3, torch.device("cpu"), seed=1)  # [N, Hq, D]
    keys = needle_keys(spec, q, ctx, margin=4.0)  # [N, H, D]
    logits = (q * keys.repeat_interleave(spec.gqa_group, dim=1)).sum(-1) / math.sqrt(spec.head_dim)  # [N, Hq]
    assert float(logits.min()) >= math.log(ctx) + 4.0


def test_suites_skip_smollm2_parts_when_the_wheel_is_absent(tmp_path, monkeypatch):
    monkeypatch.setitem(weights.PACKAGED_MODELS, "smollm2-135m", ("no_such_package_kvtier", "x.gguf", "no-such==0"))
    rc = main(["bench", "quality", "--preset", "quick", "--smallest", "--device", "cpu", "--no-plots",
               "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0
    assert "no-such==0" in results["suites"]["quality"]["skipped"]


def test_h200_preset_needs_cuda(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the h200 preset")
    assert main(["bench", "decode", "--preset", "h200", "--out", str(tmp_path)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_bad_set_is_refused_before_anything_runs(tmp_path, capsys):
    assert main(["bench", "all", "--set", "decode.contexts=many", "--out", str(tmp_path / "x")]) == 2
    assert "expected" in capsys.readouterr().err and not (tmp_path / "x").exists()
