"""Contexts: content keys, fork by reference count, prefix lookup and sequences started on a prefix."""

from __future__ import annotations

import random

import pytest
import torch

from kvstore import CapacityError, Config, KVStore
from tests.kvstore.contexts.test_saved import query
from tests.kvstore.test_store import SPEC, kv



def small_config(tmp_path, **overrides) -> Config:
    base = dict(model=SPEC, block_tokens=8, sink_tokens=8, hot_tokens=32, warm_tokens=0,
                gpu_bytes=256 << 10, cpu_bytes=256 << 10, ssd_path=str(tmp_path / "ssd"), staging_tokens=64,
                ssd_bytes=64 << 20, device="cpu", host_memory_reserve=0)
    return Config(**{**base, **overrides})


def filled(store: KVStore, token_ids: list[int], seed: int) -> int:
    seq = store.create_sequence()
    store.extend_tokens(seq, token_ids)
    for layer in range(SPEC.num_layers):
        store.append(seq, layer, *kv(len(token_ids), seed + layer))
    return seq


def attend_all(store: KVStore, seq: int, q: torch.Tensor) -> list[torch.Tensor]:
    return [store.attend(seq, layer, q, mode, budget=32) for layer in range(SPEC.num_layers)
            for mode in ("dense", "topk")]


def test_ten_forks_hold_one_copy_and_free_in_any_order_leaves_nothing(tmp_path):
    store = KVStore(small_config(tmp_path))
    base = filled(store, list(range(1000, 1205)), seed=1)  # 25 full blocks + a 5-token tail per layer
    alone = store.stats()["blocks"]["stored"]
    assert alone == SPEC.num_layers * 26
    forks = [store.fork(base) for _ in range(10)]
    store.check_integrity()
    blocks = store.stats()["blocks"]
    assert blocks["stored"] == alone + 10 * SPEC.num_layers  # one copied partial tail per fork and layer
    assert blocks["references"] == 11 * alone and blocks["shared"] == SPEC.num_layers * 25
    q = query(2)
    want = attend_all(store, base, q)
    for f in forks:
        assert all(torch.equal(a, b) for a, b in zip(attend_all(store, f, q), want))
    order = forks + [base]
    random.Random(3).shuffle(order)
    for seq in order:
        store.free(seq)
        store.check_integrity()
    assert store.stats()["blocks"] == {"stored": 0, "references": 0, "shared": 0}
    assert sum(t["blocks"] for t in store.stats()["tiers"].values()) == 0
    store.close()


def test_fork_tail_is_copy_on_write_and_forks_grow_apart(tmp_path):
    store = KVStore(small_config(tmp_path))
    ids = list(range(77))
    base = filled(store, ids, seed=4)
    before = [store.read(base, layer) for layer in range(SPEC.num_layers)]
    fork = store.fork(base)
    for step in range(60):  # the fork grows past several blocks; shared blocks cool for both holders
        store.extend_tokens(fork, [5000 + step])
        for layer in range(SPEC.num_layers):
            store.append(fork, layer, *kv(1, 100 + step * 2 + layer))
        store.check_integrity()
    for layer in range(SPEC.num_layers):
        after = store.read(base, layer)
        assert torch.equal(after[0], before[layer][0]) and torch.equal(after[1], before[layer][1])
        grown = store.read(fork, layer, 0, 77)
        assert torch.equal(grown[0], before[layer][0])
    assert store.token_ids(base) == ids and store.token_ids(fork) == ids + [5000 + s for s in range(60)]
    store.free(base)
    store.check_integrity()
    assert store.read(fork, 0, 0, 77)[0].equal(before[0][0])
    store.free(fork)
    assert store.stats()["blocks"]["stored"] == 0
    store.close()


def test_h2o_drop_on_a_fork_keeps_the_blocks_the_other_holds(tmp_path):
    store = KVStore(small_config(tmp_path, recent_tokens=16))
    base = filled(store, list(range(300)), seed=5)
    fork = store.fork(base)
    q = query(6)
    store.attend(fork, 0, q, "h2o", budget=64)
    assert store.sequences[fork][0].num_dropped > 0
    store.check_integrity()
    k, v = kv(300, 5)
    got = store.read(base, 0)
    assert torch.equal(got[0][-32:], k[-32:]) and torch.equal(got[0][:8], k[:8])
    store.free(fork)
    store.free(base)
    store.check_integrity()
    assert store.stats()["blocks"]["stored"] == 0
    store.close()


def test_match_prefix_finds_the_longest_held_prefix_and_a_sequence_starts_on_it(tmp_path):
    store = KVStore(small_config(tmp_path))
    doc = list(range(7, 207))  # 200 tokens: 25 full blocks
    base = filled(store, doc, seed=7)
    assert store.match_prefix([1, 2, 3] + doc).num_tokens == 0
    assert store.match_prefix(doc[:7]).num_tokens == 0  # no full block
    question = doc[:150] + [9999] * 20
    match = store.match_prefix(question)
    assert match.num_tokens == 144 and list(match.token_ids) == doc[:144]
    seq = store.create_sequence(prefix=match)
    store.check_integrity()
    assert store.stats()["blocks"]["stored"] == SPEC.num_layers * 25  # nothing copied
    for layer in range(SPEC.num_layers):
        k, v = store.read(base, layer, 0, 144)
        got = store.read(seq, layer)
        assert torch.equal(got[0], k) and torch.equal(got[1], v)
        assert torch.equal(store.sequences[seq][layer].summaries[:18], store.sequences[base][layer].summaries[:18])
    store.extend_tokens(seq, question[144:])
    for layer in range(SPEC.num_layers):
        store.append(seq, layer, *kv(26, 50 + layer))
    store.check_integrity()
    longer = store.match_prefix(question + [1])
    assert longer.num_tokens == 168  # the new sequence's own full blocks are keyed too
    store.free(base)
    store.check_integrity()
    assert store.match_prefix(doc).num_tokens == 144  # the shared part lives on in seq
    store.free(seq)
    with pytest.raises(ValueError, match="stale"):
        store.create_sequence(prefix=match)
    assert store.stats()["blocks"]["stored"] == 0 and not store.sequences
    store.close()


def test_content_keys_depend_on_the_model_and_token_ids_must_cover_the_sequence(tmp_path):
    a = KVStore(small_config(tmp_path / "a", model_id="model-a"))
    b = KVStore(small_config(tmp_path / "b", model_id="model-b"))
    ids = list(range(64))
    sa, sb = filled(a, ids, seed=8), filled(b, ids, seed=8)
    ka = {a.tiers.blocks.key_of[i] for i in a.sequences[sa][0].block_ids}
    kb = {b.tiers.blocks.key_of[i] for i in b.sequences[sb][0].block_ids}
    assert len(ka) == 8 and not ka & kb
    raw = a.create_sequence()
    a.append(raw, 0, *kv(10, 9))
    assert not a.tracks_tokens(raw)
    with pytest.raises(ValueError, match="never given"):
        a.extend_tokens(raw, [1, 2])
    with pytest.raises(ValueError, match="non-negative ints"):
        a.extend_tokens(sa, [-1])
    for layer in range(SPEC.num_layers):  # K/V of 3 tokens ahead of their ids (a decode that ran ahead)
        a.append(sa, layer, *kv(3, 11))
    with pytest.raises(ValueError, match="only 64 token ids"):  # an ordinary extend may not paper over the lag
        a.extend_tokens(sa, [1, 2, 3])
    for wrong in ([1, 2], [1, 2, 3, 4]):  # catching up takes exactly the ids of the K/V held
        with pytest.raises(ValueError, match="catching up"):
            a.extend_tokens(sa, wrong, catch_up=True)
    a.extend_tokens(sa, [1, 2, 3], catch_up=True)
    assert a.token_ids(sa) == ids + [1, 2, 3] and a.tracks_tokens(sa)
    a.close(), b.close()


def test_fork_refused_when_the_hot_pool_cannot_take_the_tails_changes_nothing(tmp_path):
    store = KVStore(small_config(tmp_path, gpu_bytes=40 << 10, staging_tokens=8))
    seqs = []
    with pytest.raises(CapacityError):
        for i in range(40):
            seqs.append(filled(store, list(range(i, i + 13)), seed=10 + i) if not seqs else store.fork(seqs[0]))
    store.check_integrity()
    held = store.stats()["blocks"]
    assert len(store.sequences) == len(seqs) and held["stored"] == SPEC.num_layers * (1 + len(seqs))
    for seq in seqs:
        store.free(seq)
    store.check_integrity()
    assert store.stats()["blocks"]["stored"] == 0
    store.close()


def test_two_prefills_of_one_prompt_share_keys_and_a_prefix_finds_the_first_still_held(tmp_path):
    store = KVStore(small_config(tmp_path))
    doc = list(range(300, 364))  # 8 full blocks
    first, second, third = (filled(store, doc, seed=s) for s in (20, 21, 22))
    blocks = {seq: tuple(store.sequences[seq][0].block_ids[:8]) for seq in (first, second, third)}
    assert store.match_prefix(doc).block_ids[0] == blocks[first]
    store.check_integrity()
    store.free(second)  # a later block of the key goes: the first still answers
    assert store.match_prefix(doc).block_ids[0] == blocks[first]
    store.free(first)  # the first goes: the next still held answers
    assert store.match_prefix(doc).block_ids[0] == blocks[third]
    store.check_integrity()
    store.free(third)
    assert store.match_prefix(doc).num_tokens == 0 and store.stats()["blocks"]["stored"] == 0
    store.check_integrity()
    store.close()
