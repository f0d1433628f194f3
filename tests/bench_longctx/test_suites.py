"""Pieces of the suites that the end-to-end run cannot pin down: the captured decode path against the
eager one, the needle construction, the skip paths, and bad input."""

from __future__ import annotations

import json

import pytest
import torch

from bench_longctx.e2e import appended_kv_matches
from bench_longctx.e2e_setup import model_args, random_model
from bench_longctx.models import model_store
from bench_longctx.needle import haystack, key_distribution, logits
from bench_longctx.presets import NeedlePreset
from engine_adapter.graph_decode import GraphDecoder
from engine_adapter import weights
from engine_adapter.decoder import Decoder
from bench_longctx.cli import main
from kvstore.config import ModelSpec


@pytest.mark.parametrize("mode", ["dense", "topk"])
def test_graph_decoder_generates_what_the_eager_decoder_does(mode):
    """The captured path's forward (run eagerly on CPU) against Decoder.decode_step on an identical prefill:
    same logits, same greedy tokens, and every token's K/V appended."""
    args = model_args("smollm2-135m", layers=2)
    model = random_model(args, torch.device("cpu"), torch.float32, seed=3)
    stores = [model_store(args.spec, torch.device("cpu"), hot_tokens=96, warm_tokens=2048, sink_tokens=32,
                          recent_tokens=64, sequences=1) for _ in range(2)]
    prompt = torch.randint(0, args.vocab_size, (790,), generator=torch.Generator().manual_seed(0))
    seqs = [s.create_sequence() for s in stores]
    with torch.no_grad():
        first = [Decoder(model, s).prefill(q, prompt, chunk_tokens=256) for s, q in zip(stores, seqs)]
    assert stores[0].stats()["tiers"]["warm"]["blocks"] > 0  # the step reads fp16 and int8 blocks
    eager, graph = Decoder(model, stores[0]), GraphDecoder(model, stores[1], seqs[1], mode, budget=256)
    token = int(first[0].argmax())
    for _ in range(14):  # crosses a block boundary at 800 (block_tokens 32)
        want = eager.decode_step(seqs[0], token, mode, 256)
        got = graph(token)[0]
        assert torch.allclose(got, want, atol=1e-3, rtol=1e-3)
        token = int(want.argmax())
        assert int(got.argmax()) == token
    assert stores[1].table(seqs[1], 0).num_tokens == 790 + 14
    assert appended_kv_matches(Decoder(model, stores[1]), seqs[1], 790, [int(first[0].argmax())])
    for s in stores:
        s.close()


@pytest.mark.parametrize("geometry, ctx", [("smollm2-135m", 5000), ("llama3-8b", 3000)])
def test_needles_are_graded_norm_matched_and_follow_smollm2_keys(geometry, ctx):
    spec = ModelSpec.preset(geometry, num_layers=1)
    p = NeedlePreset(needles=6, sink_tokens=64, recent_tokens=128, block_tokens=32)
    hay = haystack(spec, ctx, p, torch.device("cpu"), seed=ctx)
    keys = hay["keys"].float()  # [T, H, D]
    mean, chol = key_distribution(spec, p.key_layer, torch.device("cpu"))
    background = torch.ones(ctx, dtype=torch.bool)
    background[hay["positions"]] = False
    n = int(background.sum())
    want_cov = chol @ chol.transpose(1, 2)  # [H, D, D]
    std = want_cov.diagonal(dim1=1, dim2=2).sqrt()  # [H, D]
    assert ((keys[background].mean(0) - mean).abs() <= 5 * std / n**0.5 + 2e-3).all()  # the shared mean direction
    cov = torch.einsum("thd,the->hde", keys[background] - mean, keys[background] - mean) / n
    scale = std[:, :, None] * std[:, None, :]
    assert ((cov - want_cov).abs() <= 6 * scale / n**0.5 + 2e-3 * scale.amax()).all()  # covariance, not only scales
    assert (want_cov - torch.diag_embed(want_cov.diagonal(dim1=1, dim2=2))).abs().amax() > 0.1 * scale.amax()
    planted = keys[hay["positions"]].norm(dim=-1)  # [N, H]
    torch.testing.assert_close(planted, hay["replaced_norms"], rtol=2e-3, atol=0)  # as long as the key they replace
    weights = hay["weights"]  # [N, Hq]: exact dense weight of each needle for each head
    for i, pos in enumerate(hay["positions"]):
        want = torch.softmax(logits(hay["queries"][i], hay["keys"]), dim=1)[:, pos]
        torch.testing.assert_close(weights[i], want)
    by_margin = weights.mean(1)[torch.tensor(hay["margins"]).argsort()]
    assert by_margin[0] < 0.2 and by_margin[-1] > 0.6  # graded: from a few % to most of the dense softmax
    assert float(weights.min()) < 0.02 and float(weights.max()) > 0.95
    assert float((weights >= p.min_weight).float().mean()) > 0.5


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


def test_serve_trace_finishes_every_request_on_every_store():
    """`kvtier bench serve` on a small trace: every request of every store finishes with its appended K/V
    intact."""
    from bench_longctx.presets import get_preset
    from bench_longctx.serve_bench import run_serve
    from bench_longctx.timing import Deadline
    import dataclasses

    p = dataclasses.replace(get_preset("quick").serve, layers=2, requests=4, output_tokens=4)
    result = run_serve(p, torch.device("cpu"), Deadline(600), lambda items, _name: items)
    runs = result["runs"]
    assert set(runs) == {"kvtier", "dense-fp16", "dense-int8"}
    for run in runs.values():
        assert "error" not in run, run
        assert run["requests"] == 4 and run["output_tokens"] == 16 and run["appended_verified"] == "4/4"
        split = run["steady_step_ms"]  # steady steps, split by whether a sequence opened new tail blocks in them
        steady = run["steps"] - run["steps_with_fill_or_capture"]
        assert split["opening_tails"]["steps"] + split["other"]["steps"] == steady
        assert all(x["max"] >= x["p50"] >= 0 for x in split.values())


def test_the_warm_format_setting_reaches_the_stores():
    """serve.warm_format sets the kvtier store's warm and cpu format (dense-int8 stays int8) and the trace
    still finishes intact; e2e.warm_format sets the e2e store's."""
    from bench_longctx.e2e_setup import e2e_store
    from bench_longctx.presets import get_preset, override
    from bench_longctx.serve_bench import run_serve
    from bench_longctx.timing import Deadline
    import dataclasses

    preset = override(override(get_preset("quick"), "serve.warm_format=int4"), "e2e.warm_format=fp8")
    p = dataclasses.replace(preset.serve, layers=2, requests=2, output_tokens=2, contexts=(1024,),
                            stores="kvtier,dense-int8")
    runs = run_serve(p, torch.device("cpu"), Deadline(600), lambda items, _name: items)["runs"]
    assert runs["kvtier"]["warm_format"] == "int4" and runs["dense-int8"]["warm_format"] == "int8"
    assert all(run["appended_verified"] == "2/2" for run in runs.values()), runs
    store = e2e_store(model_args("smollm2-135m", layers=1).spec, preset.e2e, torch.device("cpu"))
    assert (store.config.warm_format, store.config.cpu_dtype) == ("fp8", "fp8")
    store.close()


def test_batch_step_profile_splits_boundary_steps(tmp_path):
    """step_profile --batch: one wall time per step over two blocks' worth of steps, the steps where the
    sequences open new tail blocks told apart (exactly one per block), written to the result JSON."""
    from bench_longctx.step_profile import main as profile

    assert profile(["--out", str(tmp_path), "--batch", "2", "--context", "700", "--steps", "2", "--geometry",
                 "smollm2-135m", "--layers", "2", "--device", "cpu"]) == 0
    result = json.loads((tmp_path / "step_profile_batch2_topk_700.json").read_text())
    b = result["block_tokens"]
    assert len(result["step_ms"]) == len(result["step_opens_tails"]) == 2 * b
    assert sum(result["step_opens_tails"]) == 2 == len(result["boundary_step_ms"])
    first = 700 + 4 + 2  # the context, the compile steps and the timed steps before the walk
    assert [i for i, o in enumerate(result["step_opens_tails"]) if o] == [i for i in range(2 * b)
                                                                          if (first + i) % b == 0]
