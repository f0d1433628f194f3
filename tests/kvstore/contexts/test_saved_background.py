"""open(name, background_load=True): a thread reads the opened context's blocks while the store serves it, and
place_loaded puts what was read into the tiers store.load would, a bounded number of batches per call; outputs
stay equal throughout, a failed read is raised once, and free and close stop the thread."""

from __future__ import annotations

import time

import pytest
import torch

from kvstore import KVStore
from kvstore.blocks.tierset import CPU_TIER, WARM_TIER
from kvstore.contexts.background_load import QUEUED
from tests.kvstore.contexts.test_saved import NUM_TOKENS, attend_all, filled, query
from tests.kvstore.contexts.test_saved_integrity import flip_byte
from tests.kvstore.contexts.test_saved_load import opened, saved_blocks
from tiers.errors import BlockMissingError, IntegrityError

BATCH = 8  # blocks per background read: many batches for a 150-block layer


def background(store: KVStore, name: str = "doc") -> int:
    store.loads.batch_blocks = BATCH
    return store.open(name, background_load=True)


def place_all(store: KVStore, seq: int) -> list[int]:
    """place_loaded until the load of `seq` ended: blocks moved per call."""
    moved, deadline = [], time.monotonic() + 60
    while store.loads.loading(seq):
        assert time.monotonic() < deadline, "the background load did not finish"
        moved.append(store.place_loaded())
        time.sleep(0.002)
    return moved


def test_a_background_load_places_every_block_where_store_load_would_and_outputs_stay_equal(tmp_path):
    store, seq, want = opened(tmp_path, cpu_bytes=4 << 20)
    loaded, _, _ = opened(tmp_path / "other", cpu_bytes=4 << 20)  # the same save, moved by store.load
    loaded_seq = loaded.open("doc")
    loaded.load(loaded_seq)
    store.free(seq)
    seq = background(store)
    before = saved_blocks(store, seq)
    assert before > 100 and store.loads.loading(seq)
    moved = place_all(store, seq)
    assert sum(moved) <= before and max(moved) <= QUEUED * BATCH  # a bounded pause per call
    assert saved_blocks(store, seq) == 0 and store.place_loaded() == 0
    for table, other in zip(store.sequences[seq], loaded.sequences[loaded_seq]):
        n = table.num_blocks
        assert torch.equal(table.tier_map[:n], other.tier_map[:n])  # hot and warm windows, the rest in cpu
    store.check_integrity()
    assert all(a.equal(b) for a, b in zip(attend_all(store, seq, query(3)), want))
    store.close(), loaded.close()


def test_blocks_that_left_the_save_meanwhile_are_skipped_and_full_gpu_windows_spill_into_cpu(tmp_path):
    """Attends while loading read their selected blocks from the save and keep those read twice
    (kvstore/blocks/from_saved.py): the load skips those. With the warm pool full (sequences written into the
    store first), the warm window's blocks go to the cpu tier instead (int8 both: the same values)."""
    store, seq, want = opened(tmp_path, cpu_bytes=4 << 20)
    store.free(seq)
    tiers, seed = store.tiers, 1
    while tiers.warm.free_blocks():  # sequences written into the store fill the warm pool
        filled(store, NUM_TOKENS, seed)
        seed += 1
    seq = background(store)
    before = saved_blocks(store, seq)
    for _ in range(2):  # read twice: kept (kvstore/blocks/from_saved.py, KEEP_AFTER)
        store.attend(seq, 0, query(3), "topk", budget=64)
    kept = store.stats()["attend"]["kept_from_saved"]
    assert 0 < kept and saved_blocks(store, seq) == before - kept
    assert sum(place_all(store, seq)) == before - kept and saved_blocks(store, seq) == 0
    warm_window = [tiers.blocks.tier_of[b] for t in store.sequences[seq] for i, b in enumerate(t.block_ids)
                   if tiers.first_tier(i, t.num_tokens) == WARM_TIER]
    assert warm_window and set(warm_window) == {CPU_TIER}
    store.check_integrity()
    assert all(a.equal(b) for a, b in zip(attend_all(store, seq, query(3)), want))
    store.close()


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_a_failed_read_is_raised_once_by_place_loaded_and_the_load_ends(tmp_path, damage):
    store, seq, _ = opened(tmp_path, cpu_bytes=4 << 20)
    key = store.tiers.saved.key(store.sequences[seq][1].block_ids[40])
    store.free(seq)
    if damage == "flip":
        flip_byte(store, b"", key)
    else:
        with store.saved.values.env.begin(write=True) as txn:
            assert txn.delete(key)
    seq = background(store)
    error = IntegrityError if damage == "flip" else BlockMissingError
    with pytest.raises(error):
        place_all(store, seq)
    assert not store.loads.loading(seq) and store.place_loaded() == 0
    assert 0 < saved_blocks(store, seq)  # what was placed before stays placed; the damaged batch is not
    store.free(seq)  # (a store's check_integrity reads every adopted block's value: the deleted one is gone)
    store.check_integrity()
    store.close()


def test_free_and_close_stop_the_reading_thread(tmp_path):
    store, seq, _ = opened(tmp_path, cpu_bytes=4 << 20)
    store.free(seq)
    first, second = background(store), background(store)
    threads = [store.loads.loads[s]._thread for s in (first, second)]
    assert all(t.is_alive() for t in threads)  # blocked on its full queue: nothing placed yet
    store.free(first)
    assert not threads[0].is_alive() and store.loads.loading(second)
    store.check_integrity()
    store.close()
    assert not threads[1].is_alive()


def test_open_refuses_a_background_load_that_is_not_a_bool_and_holds_nothing(tmp_path):
    store, seq, _ = opened(tmp_path)
    store.free(seq)
    with pytest.raises(ValueError, match="background_load must be True or False"):
        store.open("doc", background_load="yes")
    assert not store.sequences and not store.loads.loads
    store.close()
