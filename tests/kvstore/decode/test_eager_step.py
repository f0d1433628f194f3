"""store.append + store.attend through the DecodeStep's code (kvstore/decode/eager_step.py): a decode token through the
public API equals the same token through a DecodeStep of the same capacity, bit for bit (outputs, stored K/V,
summaries, sketch codes, H2O scores, stats), across block boundaries, cooling, the dense -> topk phase change, a
capacity rebuild and cpu-tier blocks (h2o: test_step_h2o.py); what the step cannot serve runs through the
DecodePath as before and is counted by reason; a caller that appends without attending, attends a layer twice or
changes mode inside a token gets correct outputs and an intact store."""

from __future__ import annotations

import pytest
import torch

from engine_adapter.decoder import Decoder
from engine_adapter.weights import random_llama
from eviction import CascadeTopK, SketchTopK, TopK, Window
from tests.engine_adapter.test_llama import TINY, store_for
from tests.kvstore.decode.test_step import DEVICE, SPEC, cold_pair, make_store, tokens, twin_stores

L = SPEC.num_layers


def room(store, seq) -> int:
    """Tokens the sequence's tables have room for: the capacity the step of its first API token takes."""
    return min(store.table(seq, layer).summaries.shape[0] for layer in range(L)) * store.config.block_tokens


def api_token(store, seq, q_k_v, **attend) -> list[torch.Tensor]:
    """One decode token through the public API: per layer, append then attend."""
    outs = []
    for layer, (q, k, v) in enumerate(q_k_v):
        store.append(seq, layer, k[None], v[None])
        outs.append(store.attend(seq, layer, q, **attend))
    return outs


def assert_same_contents(a, b, sa, sb) -> None:
    a.check_integrity(), b.check_integrity()
    for layer in range(L):
        ta, tb = a.table(sa, layer), b.table(sb, layer)
        n = ta.num_blocks
        assert ta.num_tokens == tb.num_tokens and n == tb.num_blocks
        for x, y in zip(a.read(sa, layer), b.read(sb, layer)):
            assert torch.equal(x, y)
        assert torch.equal(ta.summaries[:n], tb.summaries[:n]) and torch.equal(ta.sketch[:n], tb.sketch[:n])
        assert torch.equal(ta.h2o_scores[:, :n], tb.h2o_scores[:, :n])
    sa_, sb_ = a.stats()["attend"], b.stats()["attend"]
    for key in ("calls", "context_tokens", "attended_tokens", "certified_calls", "certified_omitted",
                "cold_slices_staged", "promotions"):
        assert sa_[key] == sb_[key], key


def step_alongside(api, stepped, sa, sb, mode: str, budget: int, num_tokens: int, seed: int) -> None:
    """num_tokens tokens through api.append + api.attend and through a DecodeStep of `stepped` (the capacity the
    API's step takes: the tables' room, then the default once that is full); every output equal."""
    step = stepped.decode_step(sb, mode=mode, budget=budget, capacity_tokens=room(stepped, sb))
    work = tokens(num_tokens, seed=seed)
    for t in range(num_tokens):
        if step.length + 1 > step.capacity * step.block_tokens:
            step = stepped.decode_step(sb, mode=mode, budget=budget)
        step.begin_token()
        token = work[t * L: (t + 1) * L]
        outs = api_token(api, sa, token, mode=mode, budget=budget)
        for layer, ((q, k, v), got) in enumerate(zip(token, outs)):
            assert torch.equal(got, step.attend(layer, q, k, v)), (t, layer)
        step.end_token()
    step.verify()


@pytest.mark.parametrize("mode, budget, num_tokens", [
    ("dense", 4096, 170), ("topk", 128, 300), ("sketch", 128, 100), ("cascade", 128, 100), ("window", 128, 100),
    (SketchTopK(coarse_factor=2, min_candidates=8), 128, 60), (CascadeTopK(candidate_factor=2), 128, 60),
    (TopK(), 128, 60), (Window(), 128, 60)], ids=lambda x: x if isinstance(x, (str, int)) else type(x).__name__)
def test_store_attend_runs_the_decode_step(tmp_path, mode, budget, num_tokens):
    """From 100 tokens: block boundaries, hot -> warm cooling (past 128), the topk phase (from 128 tokens); topk to
    400, past the tables' room (368 tokens), where the step is built again with more capacity. A policy instance
    whose settings the step implements runs through a step of its own settings."""
    api, stepped, sa, sb = twin_stores(tmp_path, 100, seed=0)
    step_alongside(api, stepped, sa, sb, mode, budget, num_tokens, seed=1)
    attend = api.stats()["attend"]
    assert attend["step_calls"] == num_tokens * L and attend["fallback_calls"] == {}
    assert attend["calls"] == num_tokens * L
    assert api.stats()["tiers"]["warm"]["blocks"] > 0
    assert_same_contents(api, stepped, sa, sb)
    api.close(), stepped.close()


@pytest.mark.parametrize("mode", ["topk", "sketch", "cascade"])
def test_store_attend_serves_cpu_blocks_through_the_step(tmp_path, mode):
    """Most of a 600-token prefill in an int8 cpu tier the step reads itself: the API's tokens stage head slices
    inside the step (no whole-block fetch), promote blocks it keeps reading, and equal the step's."""
    api, stepped, (sa, sb) = cold_pair(tmp_path, mode)
    assert api.table(sa, 0).num_cold > 20
    step_alongside(api, stepped, sa, sb, mode, 128, 16, seed=6)  # 600 -> 616: a block boundary, cooling into cpu
    attend = api.stats()["attend"]
    assert attend["step_calls"] == 16 * L and attend["cold_slices_staged"] > 0 and attend["cold_blocks_fetched"] == 0
    assert_same_contents(api, stepped, sa, sb)
    api.close(), stepped.close()


def old_path_token(store, seq, q_k_v, mode, budget=4096, measure_mass=False, epsilon=None) -> list[torch.Tensor]:
    """What store.append + store.attend ran before: the AppendPath, then the DecodePath, per layer."""
    outs = []
    for layer, (q, k, v) in enumerate(q_k_v):
        table = store.table(seq, layer)
        store.appends.append(seq, layer, table, k[None], v[None])
        outs.append(store.decode.attend(table, q, store._policy(mode), budget, measure_mass, epsilon))
    return outs


FALLBACKS = [  # (store.attend arguments, the reason counted)
    (dict(mode=TopK(group_reduce="sum"), budget=64), "mode"),
    (dict(mode="sketch", budget=128, epsilon=0.5), "epsilon"),
    (dict(mode="topk", budget=64, measure_mass=True), "measure_mass"),
]


@pytest.mark.parametrize("attend, reason", FALLBACKS, ids=["instance", "epsilon", "measure_mass"])
def test_what_the_step_cannot_serve_runs_the_eager_path_as_before(tmp_path, attend, reason):
    api, old, sa, sb = twin_stores(tmp_path, 150, seed=2)
    work = tokens(20, seed=3)
    for t in range(20):
        token = work[t * L: (t + 1) * L]
        for got, want in zip(api_token(api, sa, token, **attend), old_path_token(old, sb, token, **attend)):
            assert torch.equal(got, want)
    stats = api.stats()["attend"]
    assert stats["step_calls"] == 0 and stats["fallback_calls"] == {reason: 20 * L}
    assert stats["mass_measured"] == old.stats()["attend"]["mass_measured"]
    api.check_integrity()
    for layer in range(L):  # the newest tokens (h2o drops older blocks for good)
        assert torch.equal(api.read(sa, layer, 150)[0], old.read(sb, layer, 150)[0])
    api.close(), old.close()


def test_blocks_beyond_the_cpu_tier_and_a_dense_phase_over_cold_blocks_fall_back(tmp_path):
    for overrides, mode in ((dict(cpu_bytes=64 << 10), "topk"), ({}, "dense")):  # blocks spill to ssd; dense + cpu
        api, old, (sa, sb) = cold_pair(tmp_path, f"{mode}-", **overrides)
        work = tokens(3, seed=4)
        for t in range(3):
            token = work[t * L: (t + 1) * L]
            for got, want in zip(api_token(api, sa, token, mode=mode, budget=128),
                                 old_path_token(old, sb, token, mode, budget=128)):
                assert torch.equal(got, want)
        attend = api.stats()["attend"]  # (the old path's promotions may bring the far blocks in reach)
        assert set(attend["fallback_calls"]) == {"not_ready"} and attend["fallback_calls"]["not_ready"] >= 2 * L
        assert attend["fallback_calls"]["not_ready"] + attend["step_calls"] == 3 * L
        api.check_integrity()
        api.close(), old.close()


def dense_reference(store, seq, layer, q) -> torch.Tensor:
    """Softmax attention of q over everything the layer holds, in fp32 from the stored K/V."""
    k, v = (x.float().repeat_interleave(SPEC.num_q_heads // SPEC.num_kv_heads, dim=1) for x in store.read(seq, layer))
    p = (torch.einsum("hd,nhd->hn", q.float(), k) / SPEC.head_dim ** 0.5).softmax(-1)
    return torch.einsum("hn,nhd->hd", p, v)


def test_unusual_call_orders_give_correct_outputs_and_an_intact_store(tmp_path):
    """Dense, every block hot (the reference: exact attention over what the store holds). Tokens at and between
    block boundaries: a layer attended twice, a mode changed inside a token, layers appended and never attended,
    all layers appended before any attend, an attend with no append; the store's contents stay what was appended,
    and the next ordinary token runs through the step again."""
    store = make_store(tmp_path, "u", hot_tokens=4096, warm_tokens=0)
    seq = store.create_sequence()
    g = torch.Generator().manual_seed(7)
    prefill = [torch.randn(47, 2, 32, generator=g).half().to(DEVICE) for _ in range(2)]
    for layer in range(L):
        store.append(seq, layer, *prefill)
    appended = [list(prefill[0]) for _ in range(L)]  # every key each layer was given, in order
    work = tokens(40, seed=8)
    for t in range(40):  # 47 -> 87 tokens: boundaries at 48, 64 and 80
        (q0, k0, v0), (q1, k1, v1) = work[t * L: (t + 1) * L]
        checks = []  # (layer, q, output) to compare with the dense reference after the token
        store.append(seq, 0, k0[None], v0[None])
        if t % 5 == 1:  # both layers appended before either attends
            store.append(seq, 1, k1[None], v1[None])
            checks += [(0, q0, store.attend(seq, 0, q0)), (1, q1, store.attend(seq, 1, q1))]
        else:
            checks.append((0, q0, store.attend(seq, 0, q0)))
            if t % 5 == 2:
                checks.append((0, q0, store.attend(seq, 0, q0)))  # layer 0 again, inside the token
            store.append(seq, 1, k1[None], v1[None])
            if t % 5 == 3:
                store.attend(seq, 1, q1, mode="topk", budget=64)  # another mode inside the token
            elif t % 5 != 4:  # 4: layer 1 appended and never attended
                checks.append((1, q1, store.attend(seq, 1, q1)))
        if t % 5 == 0:
            checks.append((1, q1, store.attend(seq, 1, q1)))  # the last layer again, after the token ended
        for layer, k in ((0, k0), (1, k1)):
            appended[layer].append(k)
        store.check_integrity()
        for layer, q, out in checks:
            torch.testing.assert_close(out.float(), dense_reference(store, seq, layer, q), atol=2e-3, rtol=2e-3)
    for layer in range(L):
        assert torch.equal(store.read(seq, layer)[0], torch.stack(appended[layer]))
    assert store.attend(seq, 0, work[0][0]).shape == (SPEC.num_q_heads, SPEC.head_dim)  # no append before it
    stats = store.stats()["attend"]
    assert stats["step_calls"] == 8 * L + 24  # the ordinary tokens, and layer 0 of those changed after it
    assert set(stats["fallback_calls"]) == {"unpaired"}
    store.close()


def test_two_sequences_interleaved_layer_by_layer_each_equal_their_step(tmp_path):
    api, stepped = make_store(tmp_path, "a"), make_store(tmp_path, "b")
    g = torch.Generator().manual_seed(9)
    seqs = []
    for length in (90, 130):
        kv = [torch.randn(length, 2, 32, generator=g).half().to(DEVICE) for _ in range(2)]
        pair = api.create_sequence(), stepped.create_sequence()
        for store, seq in zip((api, stepped), pair):
            for layer in range(L):
                store.append(seq, layer, *kv)
        seqs.append(pair)
    steps = [stepped.decode_step(sb, mode="topk", budget=64, capacity_tokens=room(stepped, sb)) for _, sb in seqs]
    work = [tokens(40, seed=10), tokens(40, seed=11)]
    for t in range(40):
        for layer in range(L):
            for i, ((sa, _), step) in enumerate(zip(seqs, steps)):
                q, k, v = work[i][t * L + layer]
                if layer == 0:
                    step.begin_token()
                api.append(sa, layer, k[None], v[None])
                assert torch.equal(api.attend(sa, layer, q, mode="topk", budget=64), step.attend(layer, q, k, v))
                if layer == L - 1:
                    step.end_token()
    assert api.stats()["attend"]["fallback_calls"] == {}
    for (sa, sb) in seqs:
        assert_same_contents(api, stepped, sa, sb)
    api.close(), stepped.close()


@pytest.mark.parametrize("mode", ["dense", "topk", "sketch"])
def test_decoder_without_graphs_decodes_what_its_graph_decoder_does(mode):
    """Decoder(graphs=False) (store.append + store.attend per layer) against the GraphDecoder's forward over a
    DecodeStep (run eagerly on CPU): the same tokens, logits and stored K/V, every token served by the step."""
    runs = []
    for captured in (False, True):
        with store_for(TINY) as store:
            decoder = Decoder(random_llama(TINY, seed=5, vocab_size=97), store, graphs=captured)
            decoder._captures = lambda: captured  # the captured path's forward runs eagerly off CUDA
            seq = store.create_sequence()
            out = decoder.generate(seq, list(range(7, 47)), 40, mode, 48)
            store.check_integrity()
            attend = store.stats()["attend"]
            assert attend["step_calls"] == (0 if captured else 39 * TINY.num_layers)
            assert attend["fallback_calls"] == {}
            runs.append((out, store.read(seq, 1)))
    (out_a, (k_a, v_a)), (out_b, (k_b, v_b)) = runs
    assert out_a == out_b and torch.equal(k_a, k_b) and torch.equal(v_a, v_b)


def test_a_step_of_settings_it_does_not_implement_is_refused_clearly(tmp_path):
    store = make_store(tmp_path, "refused")
    seq = store.create_sequence()
    basis = torch.eye(SPEC.head_dim).expand(SPEC.num_kv_heads, -1, -1)
    for mode in (TopK(group_reduce="sum"), CascadeTopK(basis=basis)):
        with pytest.raises(ValueError, match="the decode step serves modes"):
            store.decode_step(seq, mode=mode)
    store.close()
