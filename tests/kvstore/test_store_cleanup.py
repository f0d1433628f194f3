"""A KVStore whose constructor raises leaves nothing behind: no temporary directory of its ssd tier."""

from __future__ import annotations

import tempfile

import pytest

import kvstore.store
from kvstore import KVStore
from tests.kvstore.contexts.test_saved import config


def fails_after_the_tiers_open(*args, **kwargs):
    raise MemoryError("no room for the decode path's buffers")


@pytest.mark.parametrize("bad", [dict(gpu_bytes=4 << 10), dict(cpu_checksums="bogus"), "late"],
                         ids=["gpu-bytes-too-small", "cpu-checksums", "after-the-tiers"])
def test_a_failed_constructor_leaves_no_temporary_directory(tmp_path, monkeypatch, bad):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp puts the ssd tier's directory
    with KVStore(config("unused", ssd_path=None)):
        assert len(list(tmp_path.iterdir())) == 1  # an opened store has one there, removed on close
    assert list(tmp_path.iterdir()) == []
    overrides = dict(ssd_path=None)
    if bad == "late":
        monkeypatch.setattr(kvstore.store, "DecodePath", fails_after_the_tiers_open)
    else:
        overrides.update(bad)
    with pytest.raises((ValueError, MemoryError)):
        KVStore(config("unused", **overrides))
    assert list(tmp_path.iterdir()) == []
