"""free(seq, background=True): the sequence is gone at once, its blocks return to their tiers in bounded
batches (release_freed), each batch leaving the store consistent, the end state that of an immediate free."""

from __future__ import annotations

import pytest
import torch

from kvstore import KVStore
from tests.kvstore.contexts.test_sequences import attend_all, filled, small_config
from tests.kvstore.contexts.test_saved import query
from tests.kvstore.test_store import SPEC


def tiers_used(store: KVStore) -> dict[str, int]:
    return {name: t["blocks"] for name, t in store.stats()["tiers"].items()}


def spread(path) -> tuple[KVStore, int, int]:
    """A store with two sequences whose blocks span the hot, warm, cpu and ssd tiers, one with dropped blocks."""
    store = KVStore(small_config(path, warm_tokens=64, gpu_bytes=64 << 10, cpu_bytes=48 << 10))
    first = filled(store, list(range(1000, 1437)), seed=1)  # 54 full blocks + a 5-token tail per layer
    second = filled(store, list(range(5000, 5300)), seed=9)
    store.drop(first, 1, [3, 4, 17])
    used = tiers_used(store)
    assert used["hot"] and used["warm"] and used["cpu"] and used["ssd"]  # every tier holds some
    return store, first, second


def test_a_background_free_returns_blocks_in_bounded_batches_and_ends_as_an_immediate_free(tmp_path):
    store, first, second = spread(tmp_path / "background")
    entries = sum(store.table(first, layer).num_blocks for layer in range(SPEC.num_layers))
    before_free = store.free_blocks()

    store.free(first, background=True)
    with pytest.raises(KeyError):
        store.table(first, 0)
    with pytest.raises(KeyError):
        store.free(first)
    assert store.freeing_blocks() == entries
    assert store.stats()["sequences"]["count"] == 1 and store.free_blocks() == before_free  # nothing back yet
    store.check_integrity()

    returned, room = [], [store.free_blocks()]
    while store.freeing_blocks():
        returned.append(store.release_freed(7))
        store.check_integrity()  # each batch leaves consistent, shorter tables
        room.append(store.free_blocks())
    assert sum(returned) == entries and all(n <= 7 for n in returned) and returned[-1] > 0
    assert room == sorted(room) and room[-1] > room[0]
    assert store.release_freed() == 0 and first not in store.sequences

    alone, a, b = spread(tmp_path / "immediate")
    alone.free(a)
    assert tiers_used(store) == tiers_used(alone) and store.free_blocks() == alone.free_blocks()
    q = query(4)  # the other sequence reads what it reads after an immediate free
    assert all(torch.equal(x, y) for x, y in zip(attend_all(store, second, q), attend_all(alone, b, q)))
    alone.close()
    store.close()


def test_blocks_a_fork_shares_stay_while_the_freed_original_returns_its_own(tmp_path):
    store = KVStore(small_config(tmp_path))
    base = filled(store, list(range(1000, 1205)), seed=1)
    fork = store.fork(base)
    q = query(2)
    want = attend_all(store, fork, q)
    store.free(base, background=True)
    while store.release_freed(5):
        store.check_integrity()
        assert all(torch.equal(a, b) for a, b in zip(attend_all(store, fork, q), want))
    assert store.stats()["blocks"]["shared"] == 0 and store.stats()["sequences"]["count"] == 1
    store.free(fork)
    assert store.stats()["blocks"] == {"stored": 0, "references": 0, "shared": 0}
    store.close()


def test_a_prefix_still_being_freed_is_found_and_shared_by_a_new_sequence(tmp_path):
    store = KVStore(small_config(tmp_path))
    ids = list(range(1000, 1205))
    base = filled(store, ids, seed=1)
    store.free(base, background=True)
    store.release_freed(3)  # the newest entries of the last layer went; the rest are still held
    match = store.match_prefix(ids)
    assert 0 < match.num_tokens < len(ids)
    seq = store.create_sequence(prefix=match)
    store.release_freed(None)
    store.check_integrity()
    for layer in range(SPEC.num_layers):  # the shared prefix survives its first holder
        assert torch.equal(store.read(seq, layer)[0], filled_read(tmp_path, ids, layer, match.num_tokens))
    assert store.stats()["sequences"]["count"] == 1
    store.close()


def filled_read(tmp_path, ids: list[int], layer: int, num_tokens: int) -> torch.Tensor:
    with KVStore(small_config(tmp_path / "reference")) as reference:
        return reference.read(filled(reference, ids, seed=1), layer, 0, num_tokens)[0]


@pytest.mark.parametrize("bad", [-1, 2.5, True, "all"])
def test_release_freed_refuses_a_bad_batch(tmp_path, bad):
    with KVStore(small_config(tmp_path)) as store:
        seq = filled(store, list(range(100)), seed=1)
        store.free(seq, background=True)
        with pytest.raises(ValueError):
            store.release_freed(bad)
        with pytest.raises(ValueError):
            store.free(filled(store, list(range(50)), seed=2), background=1)
        assert store.freeing_blocks() == sum(-(-100 // 8) for _ in range(SPEC.num_layers))
