"""A re-save or delete killed after its commit (the replaced save's data not yet deleted) leaves data no
manifest owns: collect_garbage frees all of it and nothing a manifest owns, in LMDB and in Redis."""

from __future__ import annotations

import pytest

from kvstore import KVStore
from tests.kvstore.contexts.test_saved import attend_all, filled, query
from tests.kvstore.contexts.test_saved_resave import equal, grow, make_config  # noqa: F401  (fixture: LMDB or Redis)
from tests.tiers.redis_servers import redis_server  # noqa: F401  (fixture)


class Killed(BaseException):
    """The process dies here: nothing after it runs."""


def killed_at_deletion(store: KVStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next deletion of a save's data kills the writer (it comes after the commit)."""
    def die(prefix: bytes) -> None:
        raise Killed(prefix)
    monkeypatch.setattr(store.saved.values, "delete_prefix", die)


def data_ids(store: KVStore) -> set[str]:
    """The save ids that hold data."""
    return {k.split(b"/")[2].decode() for k in store.saved.values.keys(b"ctx/data/")}


def owned(store: KVStore) -> set[str]:
    """The save ids the manifests own: their own and those they inherited."""
    reader = store.saved.reader
    return {s for name in reader.names() for m in [reader.read_manifest(name)] for s in [m["save_id"], *m["inherits"]]}


def other_keys(store: KVStore) -> list[bytes]:
    """Saved-context keys that are neither a manifest, a save's data nor a content-keyed block."""
    return [k for k in store.saved.values.keys(b"ctx/") if not k.startswith((b"ctx/name/", b"ctx/data/", b"ctx/block/"))]



def test_a_re_save_killed_before_deleting_the_replaced_data_leaves_it_to_collect_garbage(make_config, monkeypatch):
    store = KVStore(make_config())
    store.save(filled(store, 300, seed=61), "doc")
    replaced = data_ids(store)
    seq = filled(store, 300, seed=62)
    want = attend_all(store, seq, query(6))
    killed_at_deletion(store, monkeypatch)
    with pytest.raises(Killed):
        store.save(seq, "doc")
    monkeypatch.undo()
    assert replaced < data_ids(store) and not replaced & owned(store)  # committed; the replaced data is left
    assert store.saved.collect_garbage() == 1
    assert data_ids(store) == owned(store) and len(owned(store)) == 1 and other_keys(store) == []
    assert equal(attend_all(store, store.open("doc"), query(6)), want)
    store.close()


def test_a_killed_re_save_of_an_opened_context_keeps_what_the_new_save_inherited(make_config, monkeypatch):
    """The opened sequence still reads the first save, so the re-save inherits it: nothing of it is garbage."""
    store = KVStore(make_config())
    store.save(filled(store, 300, seed=63), "doc")
    store.save(filled(store, 300, seed=64), "doc")  # the first save's data is deleted; this one's is opened
    opened = store.open("doc")
    grow(store, opened, 0)
    want = attend_all(store, opened, query(7))
    killed_at_deletion(store, monkeypatch)
    store.save(opened, "doc")  # nothing to delete: the replaced save is inherited
    monkeypatch.undo()
    assert len(owned(store)) == 2 and data_ids(store) == owned(store)
    store.save(filled(store, 300, seed=65), "other")
    killed_at_deletion(store, monkeypatch)
    with pytest.raises(Killed):
        store.save(filled(store, 300, seed=66), "other")
    monkeypatch.undo()
    assert store.saved.collect_garbage() == 1
    assert data_ids(store) == owned(store) and len(owned(store)) == 3 and other_keys(store) == []
    assert equal(attend_all(store, opened, query(7)), want)
    assert equal(attend_all(store, store.open("doc"), query(7)), want)
    store.close()


def test_a_delete_killed_after_taking_the_manifest_leaves_its_data_to_collect_garbage(make_config, monkeypatch):
    store = KVStore(make_config())
    store.save(filled(store, 300, seed=67), "doc")
    store.save(filled(store, 300, seed=68), "kept")
    killed_at_deletion(store, monkeypatch)
    with pytest.raises(Killed):
        store.delete_saved("doc")
    monkeypatch.undo()
    assert store.saved_contexts() == ["kept"] and len(data_ids(store)) == 2
    assert store.saved.collect_garbage() == 1
    assert data_ids(store) == owned(store) and len(owned(store)) == 1 and other_keys(store) == []
    store.open("kept")
    store.close()
