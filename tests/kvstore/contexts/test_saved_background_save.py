"""store.save(seq, name, background=True): a SaveJob saves the sequence as it was at the call while it and other
sequences decode, pump_saves copying a bounded part per call; it opens bit-equal to the state at the call, even
after blocks changed tier (and format) meanwhile. A failing write (a full LMDB map, Redis gone) is raised by wait()
and leaves the earlier save; free and close abort a save before its commit, leaving nothing under the name."""

from __future__ import annotations

import time

import pytest
import redis
import torch

from engine_adapter.decoder import Decoder
from engine_adapter.weights import random_llama
from kvstore import KVStore
from kvstore.contexts.background_save import SaveAborted
from tests.kvstore.contexts.test_saved import NUM_TOKENS, SPEC, attend_all, config, filled, opened_config, query, \
    worker
from tests.kvstore.contexts.test_saved_durability import data_keys
from tests.kvstore.contexts.test_saved_resave import equal, grow, make_config, outputs  # noqa: F401  (fixture)
from tests.tiers.redis_servers import redis_server  # noqa: F401  (fixture)
from tiers.errors import CapacityError

VOCAB, PUMP = 512, 4  # blocks per pump (rows by their bytes): a 1203-token save (2 x 151 blocks) takes ~94 pumps


def pumped(store: KVStore, blocks: int = PUMP) -> list[int]:
    """What each store.pump_saves call copied (the Decoder calls it before every token), appended as it happens."""
    moved, pump = [], store.pump_saves
    store.pump_saves = lambda: moved.append(pump()) or moved[-1]
    store.saves.pump_blocks = blocks
    return moved


def prefilled(dec: Decoder, prompt: list[int]) -> tuple[int, int, list[int]]:
    """Two sequences prefilled (the second's blocks push the first's out of the GPU pools), their next tokens."""
    seq, other = dec.store.create_sequence(), dec.store.create_sequence()
    return seq, other, [int(dec.prefill(seq, prompt[:-1]).argmax()), int(dec.prefill(other, prompt[::-1]).argmax())]


def test_a_save_while_it_and_another_sequence_decode_opens_as_a_save_at_the_call_does(tmp_path):
    """Decoding grows the saved sequence past block boundaries, so its blocks cool (hot fp16 -> warm int8) before
    the pump reaches them: those are copied as they were, in their move. The reference saves the same state at
    once: both saves hold the same blocks, in the same formats, and open to the same K/V and logits."""
    model = random_llama(SPEC, seed=0, vocab_size=VOCAB)
    prompt = torch.randint(0, VOCAB, (NUM_TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()
    reference, dec = (Decoder(model, KVStore(opened_config(tmp_path / name, 64)), graphs=False) for name in "rs")
    (ref, _, _), (seq, other, tokens) = (prefilled(d, prompt) for d in (reference, dec))  # the same state
    store = dec.store
    want = [reference.store.read(ref, layer) for layer in range(SPEC.num_layers)]
    reference.store.save(ref, "doc")
    moved = pumped(store, 6)  # ~64 tokens: eight block boundaries
    job = store.save(seq, "doc", background=True)
    while not job.done():
        tokens = dec.decode_batch([seq, other], tokens).argmax(dim=1).tolist()
    job.wait()
    assert 0 < max(moved) <= 6 and len(moved) > 40  # a bounded part per token
    assert dec.length(seq) >= NUM_TOKENS + 40 and job.progress["blocks_copied_by_moves"] > 0
    assert job.progress["blocks_read"] == job.progress["blocks"] == SPEC.num_layers * 151
    assert content_blocks(store) == content_blocks(reference.store)  # keys name the format: fp16 or int8
    for d in (dec, reference):
        for s in list(d.store.sequences):
            d.free(s)
    opened, ref = store.open("doc"), reference.store.open("doc")
    assert store.token_ids(opened) == prompt[:-1]
    for layer in range(SPEC.num_layers):
        assert all(torch.equal(a, b) for a, b in zip(store.read(opened, layer), want[layer]))
    assert torch.equal(dec.decode_step(opened, prompt[-1]), reference.decode_step(ref, prompt[-1]))
    store.check_integrity()
    store.close(), reference.store.close()


def test_a_pump_copies_rows_by_their_bytes(tmp_path):
    """A pump's budget is in fp16 blocks' bytes: it copies rows_per_block summary and sketch code rows a block, so a
    layer's rows take that many times fewer pumps than as many blocks, and no pump copies more than its budget."""
    store = KVStore(config(tmp_path / "ssd"))
    seq = filled(store, NUM_TOKENS, seed=8)
    table = store.sequences[seq][0]
    row_bytes = table.summaries[0].nbytes + table.sketch[0].nbytes  # one block's summary row and code row
    per_block = store.saves.rows_per_block
    assert per_block == store.layout.fp16_bytes // row_bytes == 4
    blocks = rows = table.num_blocks - 1  # per layer; the tail's block and rows are copied at the call
    for name, rows_per_block in (("a", per_block), ("b", 1)):  # "b": rows counted as blocks
        store.saves.rows_per_block, store.saves.pump_blocks = rows_per_block, PUMP
        job, moved = store.save(seq, name, background=True), []
        while job.progress["state"] == "reading":
            while job.writer.outstanding:  # the writer has taken every chunk: a pump is cut short by nothing else
                time.sleep(0.001)
            moved.append(store.pump_saves())
        job.wait(timeout=60)
        assert max(moved) <= PUMP
        pumps = SPEC.num_layers * (blocks + rows / rows_per_block) / PUMP  # each full but a layer's last
        assert pumps <= len([m for m in moved if m]) <= pumps + SPEC.num_layers
    want = attend_all(store, seq, query(2))
    for name in "ab":
        assert all(torch.equal(x, y) for x, y in zip(attend_all(store, store.open(name), query(2)), want))
    store.close()


def content_blocks(store: KVStore) -> dict[bytes, bytes]:
    """Every content-keyed block value of the store's saved contexts."""
    values = store.saved.values
    keys = values.keys(b"ctx/block/")
    return dict(zip(keys, values.get(keys)))


def test_a_re_save_of_an_opened_context_in_the_background_keeps_every_live_sequence_reading(tmp_path, make_config):
    """The opened sequence's blocks still in the save are read by key by the writer (content-keyed ones are not
    written again) while the sequence grows; another sequence still reading the first save keeps reading."""
    q = query(4)
    ref_store = KVStore(config(tmp_path / "ref"))  # the same sequence, never saved
    ref = filled(ref_store, NUM_TOKENS, seed=3)
    grow(ref_store, ref, 0)
    ref_early = ref_store.fork(ref)
    grow(ref_store, ref, 1)
    want, want_early = outputs(ref_store, ref, q), outputs(ref_store, ref_early, q)
    ref_store.close()
    store = KVStore(make_config())
    seq = filled(store, NUM_TOKENS, seed=3)
    grow(store, seq, 0)
    store.save(seq, "doc")
    store.free(seq)
    early, opened = store.open("doc"), store.open("doc")
    grow(store, opened, 1)
    moved = pumped(store)
    job = store.save(opened, "doc", background=True)
    step = 2
    while not job.done():
        store.pump_saves()
        grow(store, opened, step)
        step += 1
    job.wait()
    assert max(moved) <= PUMP and step > 40 and job.progress["blocks_shared"] > 200
    assert equal(outputs(store, store.open("doc"), q), want)
    assert equal(outputs(store, early, q), want_early)  # the first save's data stayed for it
    store.check_integrity()
    store.close()


def test_content_keyed_blocks_another_save_holds_are_written_once(tmp_path):
    store = KVStore(config(tmp_path / "ssd"))
    seq = filled(store, NUM_TOKENS, seed=5)
    store.save(seq, "a")
    job = store.save(seq, "b", background=True)
    job.wait(timeout=60)  # on the store's thread: it pumps the save itself
    assert job.progress["blocks_shared"] == SPEC.num_layers * 150 and job.progress["blocks_written"] == 2
    want = attend_all(store, seq, query(2))
    assert all(torch.equal(a, b) for a, b in zip(attend_all(store, store.open("b"), query(2)), want))
    store.close()


def test_a_full_lmdb_map_fails_the_save_in_wait_and_leaves_the_earlier_save(tmp_path):
    path = tmp_path / "ssd"
    store = KVStore(config(path, cpu_bytes=4 << 20))
    earlier = filled(store, 300, seed=1)
    store.save(earlier, "doc")
    want, before = attend_all(store, earlier, query(2)), data_keys(path, store)
    env = store.saved.values.env
    env.set_mapsize((env.info()["last_pgno"] + 1) * env.stat()["psize"] + (96 << 10))  # room for a third of it
    job = store.save(filled(store, NUM_TOKENS, seed=2), "doc", background=True)
    with pytest.raises(CapacityError, match="LMDB map"):
        job.wait(timeout=60)
    assert job.done() and job.progress["state"] == "failed"
    assert set(data_keys(path, store)) - set(before) <= {b"ctx/sweep"}  # left for the next sweep
    assert all(torch.equal(a, b) for a, b in zip(attend_all(store, store.open("doc"), query(2)), want))
    store.saved.collect_garbage()
    assert data_keys(path, store) == before
    store.check_integrity()
    store.close()


def test_redis_going_away_mid_save_fails_it_in_wait_and_the_earlier_save_stays(redis_server):
    server = redis_server("--appendonly", "yes", "--appendfsync", "always")
    store = KVStore(config("unused", ssd_path=None, redis_url=server.url, cpu_bytes=4 << 20))  # no block in Redis
    earlier = filled(store, 300, seed=1)
    store.save(earlier, "doc")
    want = attend_all(store, earlier, query(2))
    store.saves.pump_blocks = PUMP
    job = store.save(filled(store, NUM_TOKENS, seed=2), "doc", background=True)
    for _ in range(20):
        store.pump_saves()
    server.kill()
    with pytest.raises(redis.ConnectionError):
        job.wait(timeout=120)
    server.start()  # the same directory: the append-only file is replayed
    assert store.saved_contexts() == ["doc"]
    assert all(torch.equal(a, b) for a, b in zip(attend_all(store, store.open("doc"), query(2)), want))
    store.close()


@pytest.mark.parametrize("earlier", [False, True])
def test_a_background_save_killed_mid_way_leaves_the_earlier_save_and_garbage_collect_garbage_removes(tmp_path,
                                                                                                    earlier):
    path = tmp_path / "ssd"
    if earlier:
        with KVStore(config(path)) as store:
            seq = filled(store, 300, seed=6)
            store.save(seq, "doc")
            want = attend_all(store, seq, query(3))
    before = data_keys(path) if earlier else []
    proc = worker("bgsave", path, "doc", 7)
    assert [proc.stdout.readline().strip() for _ in range(2)] == ["batch"] * 2  # written, the next pending
    proc.kill()  # SIGKILL, the decoding process and its writer thread at once
    proc.wait(timeout=30)
    orphans = set(data_keys(path)) - set(before)
    assert any(k.startswith(b"ctx/data/") for k in orphans) and any(k.startswith(b"ctx/pending/") for k in orphans)
    assert not any(k.startswith(b"ctx/name/") for k in orphans)
    with KVStore(config(path)) as store:
        if earlier:
            assert all(torch.equal(a, b) for a, b in zip(attend_all(store, store.open("doc"), query(3)), want))
        else:
            assert store.saved_contexts() == []
        assert store.saved.collect_garbage() == 1
    assert data_keys(path) == before


@pytest.mark.parametrize("when", ["reading", "waiting for its commit", "committed"])
def test_close_aborts_a_save_before_its_commit_and_finishes_one_after(tmp_path, when):
    path = tmp_path / "ssd"
    store = KVStore(config(path))
    earlier = filled(store, 300, seed=1)
    store.save(earlier, "doc")
    before, want = data_keys(path, store), attend_all(store, earlier, query(2))
    later = filled(store, NUM_TOKENS, seed=2)
    later_want = attend_all(store, later, query(2))
    store.saves.pump_blocks = PUMP
    job = store.save(later, "doc", background=True)
    if when != "reading":
        while job.progress["state"] == "reading":
            store.pump_saves()
        while job.progress["state"] != "committing":  # the writer syncs, then waits for a pump to commit
            time.sleep(0.01)
        if when == "committed":
            store.pump_saves()  # commits; the writer then deletes what the commit replaced
    store.close()
    assert job.done()
    store = KVStore(config(path))
    if when == "committed":
        job.wait()
        assert all(torch.equal(a, b) for a, b in zip(attend_all(store, store.open("doc"), query(2)), later_want))
    else:
        with pytest.raises(SaveAborted, match="closed before its commit"):
            job.wait()
        assert all(torch.equal(a, b) for a, b in zip(attend_all(store, store.open("doc"), query(2)), want))
        store.saved.collect_garbage()
        assert data_keys(path, store) == before
    store.close()


def test_free_aborts_a_save_still_reading_its_sequence_and_not_one_that_has_read_it(tmp_path):
    path = tmp_path / "ssd"
    store = KVStore(config(path))
    store.saves.pump_blocks = PUMP
    seq = filled(store, NUM_TOKENS, seed=6)
    want = attend_all(store, seq, query(2))
    finished, aborted = store.save(seq, "b", background=True), store.save(seq, "a", background=True)
    while finished.progress["state"] == "reading":  # the first save started takes the pump's budget first
        store.pump_saves()
    assert aborted.progress["state"] == "reading"
    store.free(seq)
    with pytest.raises(SaveAborted, match=f"sequence {seq} was freed"):
        aborted.wait(timeout=60)
    finished.wait(timeout=60)
    assert store.saved_contexts() == ["b"]
    assert all(torch.equal(a, b) for a, b in zip(attend_all(store, store.open("b"), query(2)), want))
    store.saved.collect_garbage()
    assert not [k for k in data_keys(path, store) if k.startswith(b"ctx/pending/")]
    store.check_integrity()
    store.close()


def test_save_refuses_bad_arguments_at_the_call_and_records_nothing(tmp_path):
    path = tmp_path / "ssd"
    store = KVStore(config(path))
    seq = filled(store, 100, seed=7)
    with pytest.raises(ValueError, match="background must be True or False"):
        store.save(seq, "doc", background="yes")
    with pytest.raises(ValueError, match="name must match"):
        store.save(seq, "no spaces", background=True)
    assert data_keys(path, store) == [] and not store.saves.jobs
    store.close()
