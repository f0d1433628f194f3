"""A save writes only blocks the save store does not hold yet: a fork, or a sequence started on a saved
prefix, saved after the original writes its own blocks and nothing of the shared full blocks, in LMDB as in
Redis (content keys: kvstore/contexts/save_blocks.py). LMDB keeps a shared block while any save names it."""

from __future__ import annotations

import pytest
import torch

from kvstore import KVStore
from kvstore.contexts.saved_format import BLOCK
from tests.kvstore.contexts.test_saved import SPEC, attend_all, config, filled, kv, query
from tests.kvstore.contexts.test_saved_redis import redis_config
from tests.tiers.redis_servers import redis_server  # noqa: F401  (fixture)

NUM_TOKENS, MORE = 403, 40  # 50 full blocks + a 3-token tail; the fork grows by 40 tokens (5 more blocks)


def counting_writes(store: KVStore) -> list[tuple[bytes, int]]:
    """(key, bytes) of every value the save store is handed to write from now on, appended to the list."""
    written, write_all = [], store.saved.values.write_all

    def counted(batches):
        for batch in batches:
            written.extend((k, len(v)) for k, v, _ in batch)
            yield batch

    store.saved.values.write_all = lambda batches: write_all(counted(batches))
    return written


def grow(store: KVStore, seq: int, seed: int) -> None:
    store.extend_tokens(seq, [(seed * 13 + i) % 1000 for i in range(MORE)])
    for layer in range(SPEC.num_layers):
        store.append(seq, layer, *kv(MORE, seed + layer))


@pytest.mark.parametrize("backend", ["lmdb", "redis"])
def test_saving_a_fork_writes_only_its_new_blocks(tmp_path, backend, redis_server):  # noqa: F811
    store = KVStore(config(tmp_path / "ssd") if backend == "lmdb" else redis_config(redis_server().url))
    seq = filled(store, NUM_TOKENS, seed=41)
    written = counting_writes(store)
    store.save(seq, "doc")
    blocks = [k for k, _ in written if k.startswith(BLOCK)]
    assert len(blocks) == 50 * SPEC.num_layers  # every full block under its content key (the tail: own key)
    fork = store.fork(seq)
    grow(store, fork, seed=42)
    written.clear()
    store.save(fork, "fork")
    new = [k for k, _ in written if k.startswith(BLOCK)]
    assert len(new) == 5 * SPEC.num_layers  # block 50 (the old tail, now full) to 54; none of the 50 shared
    assert not set(new) & set(blocks)
    own = [n for k, n in written if b"/b/" in k]  # the fork's own partial tail, one per layer
    assert len(own) == SPEC.num_layers
    assert store.saved.blocks.counts["blocks_shared"] == 50 * SPEC.num_layers
    assert store.saved.blocks.counts["blocks_written"] == 6 * SPEC.num_layers

    q = query(5)
    want = attend_all(store, fork, q)
    store.delete_saved("doc")  # the fork's save still names the 50 shared blocks: they stay
    opened = store.open("fork")
    assert all(torch.equal(a, b) for a, b in zip(attend_all(store, opened, q), want))
    store.free(opened)
    if backend == "lmdb":
        assert len(store.saved.values.keys(BLOCK)) == 55 * SPEC.num_layers
        store.delete_saved("fork")
        assert store.saved.values.keys(BLOCK) == []  # no save names them: swept
        assert store.saved.values.keys(b"ctx/") == []
    store.close()
