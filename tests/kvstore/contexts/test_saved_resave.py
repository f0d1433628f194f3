"""Saving under the name a live sequence was opened from ("checkpoint my conversation"): every live
sequence keeps reading, the new save opens anywhere, and the saved area stays bounded across re-saves."""

from __future__ import annotations

import pytest
import torch

from kvstore import KVStore
from tests.kvstore.contexts.test_saved import NUM_TOKENS, SPEC, config, filled, kv, query, second_write_fails
from tests.tiers.redis_servers import redis_server  # noqa: F401  (fixture)

GROW = 21  # 1203 + 21: the saved 3-token tail fills and two more blocks start


@pytest.fixture(params=["lmdb", "redis"])
def make_config(request, tmp_path):
    """make_config() -> a Config whose saved contexts live in LMDB at tmp_path, or in a fresh Redis."""
    if request.param == "lmdb":
        return lambda: config(tmp_path / "ssd")
    url = request.getfixturevalue("redis_server")().url
    return lambda: config("unused", ssd_path=None, redis_url=url)


def grow(store: KVStore, seq: int, step: int) -> None:
    store.extend_tokens(seq, [(500 + 37 * step + i) % 1000 for i in range(GROW)])
    for layer in range(SPEC.num_layers):
        store.append(seq, layer, *kv(GROW, 60 + 10 * step + layer))


def outputs(store: KVStore, seq: int, q: torch.Tensor) -> list[torch.Tensor]:
    """Sketch then top-k per layer (reads unread codes, then selected blocks), dense last (reads every block)."""
    out = [store.attend(seq, layer, q, mode, budget=64) for layer in range(SPEC.num_layers)
           for mode in ("sketch", "topk")]
    return out + [store.attend(seq, layer, q, "dense") for layer in range(SPEC.num_layers)]


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def saved_area(store: KVStore) -> tuple[int, set[bytes]]:
    """(bytes of every saved-context value, the save ids holding data)."""
    values = store.saved.values
    keys = values.keys(b"ctx/")
    size = sum(len(v) for v in values.get(keys) if v is not None)
    return size, {k.split(b"/")[2] for k in keys if k.startswith(b"ctx/data/")}


def test_an_opened_context_saved_under_its_own_name_keeps_every_live_sequence_reading(tmp_path, make_config):
    q = query(8)
    ref_store = KVStore(config(tmp_path / "ref"))  # the same sequence, never saved
    ref = filled(ref_store, NUM_TOKENS, seed=21)
    ref_early = ref_store.fork(ref)
    grow(ref_store, ref, 0)
    want, want_early = outputs(ref_store, ref, q), outputs(ref_store, ref_early, q)
    ref_store.close()

    store = KVStore(make_config())
    seq = filled(store, NUM_TOKENS, seed=21)
    store.save(seq, "doc")
    store.free(seq)
    opened = store.open("doc")
    early = store.fork(opened)  # shares the opened blocks and unread codes, never grows
    prefix = store.create_sequence(store.match_prefix(store.token_ids(opened)[:600]))
    grow(store, opened, 0)
    store.save(opened, "doc")  # replaces the save all four read from
    late = store.fork(opened)
    assert opened in store.unread and early in store.unread and prefix in store.unread
    assert equal(outputs(store, opened, q), want)
    assert equal(outputs(store, late, q), want)
    assert equal(outputs(store, early, q), want_early)
    store.attend(prefix, 0, q, "sketch", budget=64)
    store.check_integrity()
    for s in (opened, late, early, prefix):
        store.free(s)
    store.check_integrity()
    store.close()

    fresh = KVStore(make_config())
    assert equal(outputs(fresh, fresh.open("doc"), q), want)
    fresh.close()


def test_repeated_re_saves_keep_the_saved_area_bounded_and_free_leaves_nothing(make_config):
    store = KVStore(make_config())
    seq = filled(store, NUM_TOKENS, seed=22)
    store.save(seq, "doc")
    store.free(seq)
    opened = store.open("doc")
    fork = store.fork(opened)
    sizes = []
    for step in range(3):
        grow(store, opened, step)
        store.save(opened, "doc")
        size, save_ids = saved_area(store)
        assert len(save_ids) == 2  # the one the live sequences read, the newest: each re-save drops the one before
        sizes.append(size)
    assert sizes[2] < sizes[0] * 1.05  # a re-save adds the grown blocks only
    store.attend(fork, 1, query(9), "sketch", budget=64)  # the first save is still there for the fork
    grown = store.open("doc")

    before = saved_area(store)  # a failed re-save changes nothing
    with second_write_fails(store), pytest.raises(OSError, match="went away"):
        store.save(grown, "doc")
    assert saved_area(store) == before
    for s in (opened, fork, grown):
        store.free(s)
    store.check_integrity()
    store.save(filled(store, 100, seed=23), "doc")  # nothing reads the older saves now: they go
    assert len(saved_area(store)[1]) == 1
    store.delete_saved("doc")
    assert saved_area(store)[1] == set()
    store.close()


def test_replacing_an_opened_context_with_another_sequence_keeps_the_opened_one_whole(tmp_path):
    store = KVStore(config(tmp_path / "ssd"))
    seq = filled(store, NUM_TOKENS, seed=24)
    store.save(seq, "doc")
    q = query(10)
    want = outputs(store, seq, q)
    store.free(seq)
    opened = store.open("doc")
    store.unread.load_if_needed(opened)  # its codes are read: only its blocks left in the save keep it
    assert not store.saved.reader.code_readers
    store.save(filled(store, 300, seed=25), "doc")
    assert equal(outputs(store, opened, q), want)
    store.free(opened)
    store.save(filled(store, 300, seed=26), "doc")
    assert len(saved_area(store)[1]) == 1
    store.close()
