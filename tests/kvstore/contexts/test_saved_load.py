"""store.load: an opened context's blocks move from its save into the tiers their positions belong in, into free
room only, and every output stays what it was."""

from __future__ import annotations

import dataclasses

import pytest

from kvstore import KVStore
from kvstore.blocks.tierset import SAVED_TIER
from tests.kvstore.contexts.test_saved import NUM_TOKENS, SPEC, attend_all, filled, opened_config, query


def saved_blocks(store: KVStore, seq: int) -> int:
    return sum(store.tiers.blocks.tier_of[b] == SAVED_TIER for t in store.sequences[seq] for b in t.block_ids)


def opened(tmp_path, **overrides) -> tuple[KVStore, int, list]:
    """A store that opened 'doc' (saved by another store on the same path), and the writer's outputs."""
    config = opened_config(tmp_path / "ssd", 64)
    with KVStore(config) as writer:
        seq = filled(writer, NUM_TOKENS, seed=11)
        writer.save(seq, "doc")
        want = attend_all(writer, seq, query(3))
    store = KVStore(dataclasses.replace(config, **overrides))
    return store, store.open("doc"), want


def test_load_moves_every_saved_block_in_steps_and_outputs_stay_equal(tmp_path):
    store, seq, want = opened(tmp_path, cpu_bytes=4 << 20)
    left = saved_blocks(store, seq)
    assert left > 100
    assert store.load(seq, max_blocks=40) == 40 and saved_blocks(store, seq) == left - 40  # bounded
    tier_of, ids = store.tiers.blocks.tier_of, store.sequences[seq][0].block_ids
    still = [i for i, b in enumerate(ids) if tier_of[b] == SAVED_TIER]
    assert still == list(range(1, still[-1] + 1))  # newest first: what stays saved is the oldest run after the sink
    while store.load(seq, max_blocks=100):
        store.check_integrity()
    assert saved_blocks(store, seq) == 0 and store.load(seq) == 0
    tiers = store.stats()["tiers"]
    assert tiers["warm"]["blocks"] > 0 and tiers["cpu"]["blocks"] > 0 and tiers["saved"]["blocks"] == 0
    assert all(a.equal(b) for a, b in zip(attend_all(store, seq, query(3)), want))  # int8 cold tiers: same values
    fetched = store.stats()["attend"]["cold_blocks_fetched"]
    assert fetched > 0  # from cpu now, not from the save
    store.close()


def test_load_without_room_moves_nothing_and_loses_nothing(tmp_path):
    store, seq, want = opened(tmp_path)  # the test config's cpu tier holds 48 KiB: a few blocks
    before = saved_blocks(store, seq)
    moved = store.load(seq)
    assert saved_blocks(store, seq) == before - moved and before - moved > 0  # the rest stays in the save
    store.check_integrity()
    assert all(a.equal(b) for a, b in zip(attend_all(store, seq, query(3)), want))
    store.close()


def test_load_refuses_bad_arguments_and_changes_nothing(tmp_path):
    store, seq, _ = opened(tmp_path, cpu_bytes=4 << 20)
    before = saved_blocks(store, seq)
    for bad in (-1, 2.5, True, "3"):
        with pytest.raises(ValueError, match="max_blocks"):
            store.load(seq, bad)
    with pytest.raises(KeyError, match="unknown sequence"):
        store.load(seq + 99)
    assert saved_blocks(store, seq) == before and SPEC.num_layers == len(store.sequences[seq])
    store.close()


def test_blocks_an_attend_reads_from_the_save_again_are_kept_and_not_read_a_third_time(tmp_path):
    """The eager path keeps what it reads from the save a second time in the tiers (kvstore/blocks/from_saved.py):
    a first read keeps nothing (a block read once may never be selected again); after the second, a token with
    the same selection reads nothing from the save. Where the tiers have no room, blocks stay saved."""
    store, seq, want = opened(tmp_path, cpu_bytes=4 << 20)
    saved, reads = store.tiers.saved, []
    fetch = saved.fetch_as_stored
    saved.fetch_as_stored = lambda ids, device: reads.append(len(ids)) or fetch(ids, device)
    before, q = saved_blocks(store, seq), query(3)
    first = store.attend(seq, 0, q, "topk", budget=64)
    assert sum(reads) > 0 and saved_blocks(store, seq) == before  # read once: nothing kept
    assert store.stats()["attend"]["kept_from_saved"] == 0
    read_once, reads[:] = sum(reads), []
    assert store.attend(seq, 0, q, "topk", budget=64).equal(first) and sum(reads) == read_once
    assert store.stats()["attend"]["kept_from_saved"] == read_once  # room for all: every one kept
    assert saved_blocks(store, seq) == before - read_once
    reads.clear()
    assert store.attend(seq, 0, q, "topk", budget=64).equal(first) and not reads
    store.check_integrity()
    assert all(a.equal(b) for a, b in zip(attend_all(store, seq, q), want))
    store.close()

    full, seq, want = opened(tmp_path / "full")  # the test config's cpu tier holds a few blocks
    before = saved_blocks(full, seq)
    for _ in range(2):
        assert all(a.equal(b) for a, b in zip(attend_all(full, seq, query(3)), want))
    left = saved_blocks(full, seq)
    assert 0 < left and 0 < full.stats()["attend"]["kept_from_saved"] <= before - left  # (and some promoted)
    full.check_integrity()
    full.close()
