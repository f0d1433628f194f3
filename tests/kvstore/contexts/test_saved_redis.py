"""Saved contexts through Redis. What one process saves, other processes open and decode to the
same tokens as the saver holding the context alone; content-keyed blocks are stored once; a key Redis
lost is a clear error (real redis-server on a free loopback port: tests/tiers/redis_servers.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine_adapter.decoder import Decoder
from engine_adapter.weights import random_llama
from kvstore import KVStore
from tests.kvstore.contexts.test_saved import REPO, SPEC, attend_all, config, filled, query
from tests.tiers.redis_servers import raw_client, redis_server  # noqa: F401  (fixture)
from tiers.base import BlockMissingError
from tiers.saved_values import RedisValues

VOCAB, PROMPT, NEW_TOKENS = 512, 1203, 6
MODES = (("topk", 64), ("sketch", 64), ("dense", 4096))


def redis_config(url: str):
    return config("unused", ssd_path=None, redis_url=url)


def decode(dec: Decoder, seq: int, last: int) -> dict:
    """Attend outputs for a fixed q, then greedy tokens per mode, each on a fork of `seq` (the fork shares
    every full block: what it reads is the saved or held context)."""
    out = {"outs": attend_all(dec.store, seq, query(1))}
    for mode, budget in MODES:
        fork = dec.fork(seq)
        out[mode] = dec.continue_greedy(fork, dec.decode_step(fork, last, mode, budget), NEW_TOKENS, mode, budget)
        dec.free(fork)
    return out


def decode_opened(url: str, name: str, last: int) -> dict:
    """What another process does: open `name` through Redis and decode (saved_worker.py runs it)."""
    with KVStore(redis_config(url)) as store:
        seq = store.open(name)
        out = decode(Decoder(random_llama(SPEC, seed=0, vocab_size=VOCAB), store, graphs=False), seq, last)
        out["fetched"] = store.stats()["attend"]["cold_blocks_fetched"]  # blocks read from Redis when selected
        store.check_integrity()
    return out


def block_keys(url: str) -> list[bytes]:
    raw = raw_client(url)
    keys = list(raw.scan_iter(match=RedisValues.PREFIX + b"ctx/block/*"))
    raw.close()
    return keys


def test_two_processes_opening_a_context_through_redis_decode_what_its_saver_decodes(redis_server, tmp_path):
    url = redis_server().url
    prompt = torch.randint(0, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    store = KVStore(redis_config(url))
    dec = Decoder(random_llama(SPEC, seed=0, vocab_size=VOCAB), store, graphs=False)
    seq = store.create_sequence()
    dec.prefill(seq, prompt[:-1])
    tiers = store.stats()["tiers"]
    assert tiers["redis"]["blocks"] and tiers["cpu"]["blocks"] and tiers["hot"]["blocks"], tiers
    store.save(seq, "doc")
    full = SPEC.num_layers * ((PROMPT - 1) // 8)
    assert len(block_keys(url)) == full  # every full block under its content key
    store.save(seq, "again")  # the same content: no block stored twice
    assert len(block_keys(url)) == full and store.saved_contexts() == ["again", "doc"]
    workers = [subprocess.Popen([sys.executable, "-m", "tests.kvstore.contexts.saved_worker", "decode", url, name,
                                 tmp_path / f"{name}.pt", str(prompt[-1])], cwd=REPO) for name in ("doc", "again")]
    alone = decode(dec, seq, prompt[-1])  # the saver, holding the context alone, meanwhile
    assert all(w.wait(timeout=300) == 0 for w in workers)
    for name in ("doc", "again"):
        got = torch.load(tmp_path / f"{name}.pt")
        assert got["fetched"] > 0
        assert all(torch.equal(a, b) for a, b in zip(got["outs"], alone["outs"]))
        for mode, _ in MODES:
            assert got[mode] == alone[mode], (name, mode)
    store.delete_saved("doc")  # the save's own values go; content blocks stay for "again"
    assert store.saved_contexts() == ["again"] and len(block_keys(url)) == full
    store.close()


def test_a_key_redis_lost_is_a_clear_error_and_the_store_stays_whole(redis_server):
    url = redis_server().url
    writer = KVStore(redis_config(url))
    seq = filled(writer, 300, seed=12)
    writer.save(seq, "doc")
    writer.close()
    raw = raw_client(url)
    store = KVStore(redis_config(url))
    opened = store.open("doc")
    q = query(7)
    middle = store.tiers.saved.key_of[store.sequences[opened][0].block_ids[10]]
    raw.delete(RedisValues.PREFIX + middle)  # as if Redis's maxmemory policy evicted it
    with pytest.raises(BlockMissingError, match="gone"):
        store.attend(opened, 0, q, "dense")
    sketch = [k for k in raw.scan_iter(match=RedisValues.PREFIX + b"ctx/data/*") if b"/k/" in k]
    raw.delete(*sketch)
    with pytest.raises(BlockMissingError, match="sketch codes are gone"):
        store.attend(opened, 1, q, "sketch", budget=64)
    store.free(opened)
    assert store.stats()["blocks"]["stored"] == 0 and store.stats()["tiers"]["saved"]["blocks"] == 0
    summaries = [k for k in raw.scan_iter(match=RedisValues.PREFIX + b"ctx/data/*") if b"/m/" in k]
    raw.delete(summaries[0])
    with pytest.raises(BlockMissingError, match="summaries are gone"):
        store.open("doc")
    raw.delete(RedisValues.PREFIX + b"ctx/name/doc")
    with pytest.raises(KeyError, match="no saved context"):
        store.open("doc")
    assert not store.sequences
    store.check_integrity()
    store.close(), raw.close()


def test_a_commit_whose_reply_was_lost_keeps_the_save_and_deleting_is_one_step(redis_server, monkeypatch):
    """The manifest SET landed but its reply never came (or deleting the pending key failed): the save is
    committed, so its data must stay and the context must open; delete() takes the manifest in one GETDEL."""
    url = redis_server().url
    with KVStore(redis_config(url)) as store:
        seq = filled(store, 300, seed=3)
        want = attend_all(store, seq, query(2))
        client = store.saved.values.client
        real_set, real_delete = client.set, client.delete

        def set_then_lose_the_reply(*args, **kw):
            real_set(*args, **kw)
            raise ConnectionError("reply lost")

        monkeypatch.setattr(client, "set", set_then_lose_the_reply)
        with pytest.raises(ConnectionError, match="reply lost"):
            store.save(seq, "doc")
        monkeypatch.setattr(client, "set", real_set)

        def delete_fails_once(*keys):
            monkeypatch.setattr(client, "delete", real_delete)
            raise TimeoutError("pending key delete timed out")

        monkeypatch.setattr(client, "delete", delete_fails_once)
        store.save(seq, "other")  # committed: the failed cleanup of its pending key is not a failed save
        for name in ("doc", "other"):
            opened = store.open(name)
            assert all(torch.equal(a, b) for a, b in zip(attend_all(store, opened, query(2)), want)), name
            store.free(opened)
        store.delete_saved("doc")
        assert store.saved_contexts() == ["other"]
        with pytest.raises(KeyError, match="no saved context"):
            store.delete_saved("doc")
