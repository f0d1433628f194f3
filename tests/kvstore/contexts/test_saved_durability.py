"""Saved contexts are durable: a save killed mid-way (SIGKILL) leaves the name absent or as it was and its data
is collected; an acknowledged save survives kill -9 of its writer; a save that fails leaves nothing."""

from __future__ import annotations

from pathlib import Path

import lmdb
import pytest
import torch

from kvstore import KVStore
from tests.kvstore.contexts.test_saved import NUM_TOKENS, attend_all, config, filled, query, second_write_fails, worker


def data_keys(path: Path, store: KVStore | None = None) -> list[bytes]:
    """Every saved-context key at `path` (through `store`'s environment when this process has it open)."""
    env = store.saved.values.env if store is not None else lmdb.open(str(path), readonly=True, lock=False)
    with env.begin() as txn:
        keys = [bytes(k) for k, _ in txn.cursor() if bytes(k).startswith(b"ctx/")]
    if store is None:
        env.close()
    return keys


@pytest.mark.parametrize("earlier", [False, True])
def test_a_save_killed_mid_way_leaves_the_name_absent_or_as_it_was(tmp_path, earlier):
    path = tmp_path / "ssd"
    q = query(3)
    if earlier:  # a complete earlier save of the name must survive the interrupted one
        store = KVStore(config(path))
        seq = filled(store, 300, seed=6)
        store.save(seq, "doc")
        want = attend_all(store, seq, q)
        store.close()
    before = data_keys(path) if earlier else []
    proc = worker("save", path, "doc", 7)
    assert proc.stdout.readline().strip() == "batch"
    assert proc.stdout.readline().strip() == "batch"  # the first batch is written, the second pending
    proc.kill()  # SIGKILL
    proc.wait(timeout=30)
    orphans = set(data_keys(path)) - set(before)
    assert any(k.startswith((b"ctx/data/", b"ctx/block/")) for k in orphans) and \
        any(k.startswith(b"ctx/pending/") for k in orphans)
    assert not any(k.startswith(b"ctx/name/") for k in orphans)
    store = KVStore(config(path))
    if earlier:
        assert all(torch.equal(a, b) for a, b in zip(attend_all(store, store.open("doc"), q), want))
    else:
        with pytest.raises(KeyError):
            store.open("doc")
    assert store.saved.collect_garbage() == 1
    store.close()
    assert data_keys(path) == before  # the killed save's data and pending record are gone, nothing else


def test_an_acknowledged_save_survives_kill_9(tmp_path):
    path = tmp_path / "ssd"
    proc = worker("save", path, "doc", 8)
    while (line := proc.stdout.readline().strip()) != "saved":
        assert line == "batch"
    proc.kill()
    proc.wait(timeout=30)
    store = KVStore(config(path))
    seq = store.open("doc")
    store.check_integrity()
    reference = KVStore(config(tmp_path / "ref"))
    ref = filled(reference, NUM_TOKENS, seed=8)
    q = query(4)
    assert all(torch.equal(a, b) for a, b in zip(attend_all(store, seq, q), attend_all(reference, ref, q)))
    assert store.saved.collect_garbage() == 0
    store.close(), reference.close()


def test_a_failed_save_leaves_nothing_and_the_earlier_save_intact(tmp_path):
    path = tmp_path / "ssd"
    store = KVStore(config(path))
    seq = filled(store, 300, seed=9)
    store.save(seq, "doc")
    before = data_keys(path, store)
    with second_write_fails(store), pytest.raises(OSError, match="went away"):
        store.save(filled(store, NUM_TOKENS, seed=10), "doc")
    assert data_keys(path, store) == before
    q = query(5)
    want = attend_all(store, seq, q)
    assert all(torch.equal(a, b) for a, b in zip(attend_all(store, store.open("doc"), q), want))
    store.check_integrity()
    store.close()
