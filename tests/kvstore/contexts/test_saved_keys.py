"""A saved block names its key: a block value read under another key (an LMDB key with a
flipped bit landing on its neighbour's, a value SET under another block's key in Redis) is refused with
IntegrityError; a save of an older format is refused, not read unverified."""

from __future__ import annotations

import json

import pytest

from kvstore import KVStore
from kvstore.contexts.saved_format import MANIFEST
from tests.kvstore.contexts.test_saved import NUM_TOKENS, config, filled, query
from tests.tiers.redis_servers import raw_client, redis_server  # noqa: F401  (fixture)
from tiers.errors import IntegrityError
from tiers.saved_values import RedisValues


def adopted_keys(store: KVStore, seq: int, layer: int) -> dict[int, bytes]:
    """Block index -> key of its saved value, for the blocks of an opened sequence still read from the save."""
    saved = store.tiers.saved
    return {i: saved.key_of[b] for i, b in enumerate(store.sequences[seq][layer].block_ids) if b in saved}


def test_a_block_value_under_its_neighbours_key_in_lmdb_is_refused(tmp_path):
    """Block 41's key holds block 40's value (a damaged LMDB key that landed on another, or swapped values): the
    value names block 40's key."""
    store = KVStore(config(tmp_path / "ssd"))
    seq = filled(store, NUM_TOKENS, seed=31)
    store.save(seq, "doc")
    store.free(seq)
    opened = store.open("doc")
    keys = adopted_keys(store, opened, 1)
    with store.saved.values.env.begin(write=True) as txn:
        txn.put(keys[41], txn.get(keys[40]))
    block = store.sequences[opened][1].block_ids[41]
    with pytest.raises(IntegrityError, match=f"saved block {block}: .*does not name its key"):
        store.read(opened, 1)
    assert store.stats()["integrity_errors"] == 1
    store.read(opened, 0)  # layer 0 reads as before
    store.free(opened)
    store.check_integrity()
    store.close()


def test_a_value_set_under_another_blocks_key_in_redis_is_refused(redis_server):
    url = redis_server().url
    store = KVStore(config("unused", ssd_path=None, redis_url=url))
    seq = filled(store, 300, seed=32)
    store.save(seq, "doc")
    store.free(seq)
    opened = store.open("doc")
    keys = adopted_keys(store, opened, 0)
    raw = raw_client(url)
    raw.set(RedisValues.PREFIX + keys[11], raw.get(RedisValues.PREFIX + keys[10]))
    block = store.sequences[opened][0].block_ids[11]
    with pytest.raises(IntegrityError, match=f"saved block {block}: .*does not name its key"):
        store.attend(opened, 0, query(3), "dense")
    store.free(opened)
    store.check_integrity()
    store.close(), raw.close()


def test_a_save_of_an_older_format_is_refused_with_a_clear_error_and_can_be_deleted(tmp_path):
    store = KVStore(config(tmp_path / "ssd"))
    store.saved.values.put([(MANIFEST + b"old", json.dumps({"version": 3, "save_id": "ab" * 16}).encode())])
    assert store.saved_contexts() == ["old"]
    with pytest.raises(ValueError, match="older kvtier"):
        store.open("old")
    store.delete_saved("old")
    assert store.saved_contexts() == []
    store.close()
