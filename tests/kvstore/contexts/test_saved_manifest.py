"""A saved manifest is checksummed and names its own key: any damage to it (a changed digit, a flipped or
missing byte) or a manifest put under another name is refused with IntegrityError before the store holds
anything, in LMDB and in Redis; a damaged manifest can still be replaced and deleted."""

from __future__ import annotations

import pytest
import torch

from kvstore import KVStore
from kvstore.contexts.saved_format import MANIFEST
from tests.kvstore.contexts.test_saved import NUM_TOKENS, attend_all, filled, query
from tests.kvstore.contexts.test_saved_resave import make_config  # noqa: F401  (fixture: LMDB or Redis)
from tests.tiers.redis_servers import redis_server  # noqa: F401  (fixture)
from tiers.errors import IntegrityError

DOC = MANIFEST + b"doc"


@pytest.fixture
def saved(make_config):
    """A store whose sequence of NUM_TOKENS tokens was saved as 'doc', then freed."""
    store = KVStore(make_config())
    seq = filled(store, NUM_TOKENS, seed=51)
    store.save(seq, "doc")
    store.free(seq)
    yield store
    store.close()


def rewrite(store: KVStore, key: bytes, damage) -> None:
    values = store.saved.values
    values.put([(key, damage(bytes(values.get([DOC])[0])))])


def refused(store: KVStore, name: str = "doc") -> None:
    with pytest.raises(IntegrityError, match=f"saved context {name!r}: its manifest is damaged"):
        store.open(name)
    assert not store.sequences and store.stats()["blocks"]["stored"] == 0
    store.check_integrity()


def test_a_changed_digit_of_a_layers_token_count_is_refused(saved):
    """1203 -> 1201 tokens: the same block count, so nothing but a checksum tells."""
    raw = bytes(saved.saved.values.get([DOC])[0])
    assert raw.count(b'"num_tokens": 1203') == 2
    rewrite(saved, DOC, lambda raw: raw.replace(b'"num_tokens": 1203', b'"num_tokens": 1201', 1))
    refused(saved)


@pytest.mark.parametrize("damage", [
    lambda raw: raw[:1] + bytes([raw[1] ^ 0x01]) + raw[2:],  # the envelope
    lambda raw: raw[:9] + bytes([raw[9] ^ 0x80]) + raw[10:],  # the checksum
    lambda raw: raw[:len(raw) // 2] + bytes([raw[len(raw) // 2] ^ 0x40]) + raw[len(raw) // 2 + 1:],
    lambda raw: raw[:-1] + bytes([raw[-1] ^ 0x04]),
    lambda raw: raw[:-1],  # truncated
    lambda raw: raw[:len(raw) // 2],
    lambda raw: raw + b" ",
    lambda raw: b"",
    lambda raw: raw[:12] + b"\xff\xfe" + raw[14:],  # not UTF-8
], ids=["envelope", "checksum", "middle", "last", "truncated", "half", "extended", "empty", "not-utf8"])
def test_any_damage_to_a_manifest_raises_integrity_error(saved, damage):
    rewrite(saved, DOC, damage)
    refused(saved)


def test_a_manifest_put_under_another_name_is_refused(saved):
    rewrite(saved, MANIFEST + b"other", lambda raw: raw)
    refused(saved, "other")
    saved.open("doc")


def test_a_damaged_manifest_can_be_replaced_and_deleted(saved):
    rewrite(saved, DOC, lambda raw: raw[:-1])
    assert saved.saved_contexts() == ["doc"]
    seq = filled(saved, 300, seed=52)
    want = attend_all(saved, seq, query(5))
    saved.save(seq, "doc")
    opened = saved.open("doc")
    assert all(torch.equal(a, b) for a, b in zip(attend_all(saved, opened, query(5)), want))
    saved.free(opened)
    rewrite(saved, DOC, lambda raw: raw[:-1])
    saved.delete_saved("doc")
    assert saved.saved_contexts() == []
