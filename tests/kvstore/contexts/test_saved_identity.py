"""Content-keyed blocks in Redis are shared only within one model identity and one format: saving or opening
through Redis without Config.model_id is refused; two models of one geometry saving the same token ids each
reopen their own K/V; a block first stored as int8 leaves a later fp16 save's reopen bit-equal."""

from __future__ import annotations

import pytest
import torch

from kvstore import KVStore
from tests.kvstore.contexts.test_saved import NUM_TOKENS, SPEC, attend_all, config, filled, opened_config, query
from tests.kvstore.contexts.test_saved_resave import equal
from tests.tiers.redis_servers import raw_client, redis_server  # noqa: F401  (fixture)
from tiers.saved_values import RedisValues


def redis(url: str, **overrides) -> KVStore:
    return KVStore(config("unused", ssd_path=None, redis_url=url, **overrides))


def dense(store: KVStore, seq: int) -> list[torch.Tensor]:
    return [kv for layer in range(SPEC.num_layers) for kv in store.read(seq, layer)]



def test_saving_or_opening_through_redis_without_a_model_id_is_refused(redis_server, tmp_path):
    url = redis_server().url
    store = redis(url, model_id="")
    seq = filled(store, 300, seed=71)
    with pytest.raises(ValueError, match="Config.model_id is empty"):
        store.save(seq, "doc")
    raw = raw_client(url)
    assert list(raw.scan_iter(match=RedisValues.PREFIX + b"*")) == []  # nothing was written
    with pytest.raises(ValueError, match="Config.model_id is empty"):
        store.open("doc")
    store.close(), raw.close()
    with KVStore(config(tmp_path / "ssd", model_id="")) as local:  # LMDB: a save owns its blocks, none shared
        local.save(filled(local, 300, seed=71), "doc")
        local.open("doc")


def test_two_models_of_one_geometry_saving_the_same_token_ids_each_reopen_their_own(redis_server):
    url = redis_server().url
    want = {}
    for model_id, seed in (("model-a", 72), ("model-b", 73)):
        with redis(url, model_id=model_id) as store:
            seq = store.create_sequence()
            store.extend_tokens(seq, list(range(NUM_TOKENS)))  # the same token ids, other K/V
            other = filled(store, NUM_TOKENS, seed=seed)
            for layer in range(SPEC.num_layers):
                store.append(seq, layer, *store.read(other, layer))
            store.save(seq, model_id)
            want[model_id] = dense(store, seq)
    assert not equal(want["model-a"], want["model-b"])
    for model_id in want:
        with redis(url, model_id=model_id) as store:
            assert equal(dense(store, store.open(model_id)), want[model_id])


def test_a_block_first_saved_as_int8_leaves_a_later_fp16_saves_reopen_bit_equal(redis_server):
    """The same model, token ids and K/V, saved first from int8 tiers (warm, cpu), then from fp16 ones."""
    url = redis_server().url
    int8_tiers = opened_config("unused", warm_tokens=256).replace(ssd_path=None, redis_url=url)
    want = {}
    for name, c in (("int8", int8_tiers), ("fp16", config("unused", ssd_path=None, redis_url=url))):
        with KVStore(c) as store:
            seq = filled(store, NUM_TOKENS, seed=74)
            store.save(seq, name)
            want[name] = (dense(store, seq), attend_all(store, seq, query(8)))
    assert not equal(want["int8"][0], want["fp16"][0])  # int8 blocks read back differ from fp16 ones
    for name, c in (("int8", int8_tiers), ("fp16", config("unused", ssd_path=None, redis_url=url))):
        with KVStore(c) as store:
            opened = store.open(name)
            assert equal(dense(store, opened), want[name][0]), name
            assert equal(attend_all(store, opened, query(8)), want[name][1]), name
