"""store.attend's decode tokens replay each layer of the step as a CUDA graph (kvstore/decode/layer_graphs.py): one
recording per layer and graph key, none for later tokens of that key, outputs and stored bytes equal to the step's
kernels launched one by one (Config.eager_graphs=False). On CPU the layers run eagerly and the keys are counted as a
GPU would record them; on a GPU the same test compares replays with launches, bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.kvstore.decode.test_eager_step import api_token, assert_same_contents
from tests.kvstore.decode.test_step import DEVICE, SPEC, make_store, tokens

L = SPEC.num_layers


def prefilled(tmp_path, name: str, length: int, **overrides):
    store = make_store(tmp_path, name, **overrides)
    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(length, 2, 32, generator=g).half().to(DEVICE) for _ in range(2))
    seq = store.create_sequence()
    for layer in range(L):
        store.append(seq, layer, k, v)
    return store, seq


@pytest.mark.parametrize("mode", ["dense", "topk", "sketch"])
def test_each_layer_is_recorded_once_per_graph_key_and_replays_equal_launches(tmp_path, mode):
    """100 -> 220 tokens: dense buckets, the first warm block, the topk phase from 128 tokens."""
    graphed, sa = prefilled(tmp_path, "g", 100)
    launched, sb = prefilled(tmp_path, "l", 100, eager_graphs=False)
    work = tokens(120, seed=9)
    keys = []  # each token's graph key, in order
    for t in range(120):
        token = work[t * L: (t + 1) * L]
        for got, want in zip(api_token(graphed, sa, token, mode=mode, budget=128),
                             api_token(launched, sb, token, mode=mode, budget=128)):
            assert torch.equal(got, want), t
        (step, _, graphs), = graphed.steps.steps.values()
        keys.append(step.graph_key())
    assert_same_contents(graphed, launched, sa, sb)
    (_, _, none), = launched.steps.steps.values()
    assert none is None
    distinct = list(dict.fromkeys(keys))
    assert len(distinct) >= 2  # the test crosses a key change
    assert graphs.captures == L * len(distinct)  # keys never come back while a sequence grows
    last = {key[:2]: key for key in distinct}  # a new key replaces the graphs of its phase and staging
    assert {key[1:] for key in graphs.graphs} == set(last.values())
    assert graphed.stats()["attend"]["step_calls"] == 120 * L
    graphed.close(), launched.close()


def test_a_token_settled_part_way_leaves_the_graphs_usable(tmp_path):
    """A token whose last layer is never attended is settled by the next read; the next tokens replay the graphs
    recorded before and stay equal to launches."""
    graphed, sa = prefilled(tmp_path, "g", 150)
    launched, sb = prefilled(tmp_path, "l", 150, eager_graphs=False)
    work = tokens(12, seed=10)
    for t in range(12):
        token = work[t * L: (t + 1) * L]
        if t == 5:  # layer 0 only, then a read settles it
            for store, seq in ((graphed, sa), (launched, sb)):
                q, k, v = token[0]
                store.append(seq, 0, k[None], v[None])
                store.attend(seq, 0, q, mode="topk", budget=128)
                store.append(seq, 1, token[1][1][None], token[1][2][None])
                store.read(seq, 1)
            continue
        for got, want in zip(api_token(graphed, sa, token, mode="topk", budget=128),
                             api_token(launched, sb, token, mode="topk", budget=128)):
            assert torch.equal(got, want), t
    assert_same_contents(graphed, launched, sa, sb)
    graphed.close(), launched.close()


@pytest.mark.cuda
def test_a_capture_cuda_refuses_leaves_the_sequence_launching_its_kernels(tmp_path, monkeypatch):
    """A layer whose recording fails still ran (its output is returned); a warning says so and every later layer
    of the sequence is launched kernel by kernel, equal to a store that never captures."""
    import contextlib

    from kvstore.decode import layer_graphs

    @contextlib.contextmanager
    def refused(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")
        yield

    monkeypatch.setattr(layer_graphs.torch.cuda, "graph", refused)
    graphed, sa = prefilled(tmp_path, "g", 150)
    launched, sb = prefilled(tmp_path, "l", 150, eager_graphs=False)
    work = tokens(6, seed=11)
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        for t in range(6):
            token = work[t * L: (t + 1) * L]
            for got, want in zip(api_token(graphed, sa, token, mode="topk", budget=128),
                                 api_token(launched, sb, token, mode="topk", budget=128)):
                assert torch.equal(got, want), t
    (_, _, graphs), = graphed.steps.steps.values()
    assert graphs.failed is not None and not graphs.graphs
    assert_same_contents(graphed, launched, sa, sb)
    graphed.close(), launched.close()
