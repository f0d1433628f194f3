"""A damaged saved context is refused where it lies (open reads summaries, H2O scores and token ids in
place in the LMDB map), before the store holds anything of it; the sketch codes and blocks when first read."""

from __future__ import annotations

import pytest
import torch

from kvstore import KVStore
from kvstore.contexts.saved_format import seal_manifest
from tests.kvstore.contexts.test_saved import NUM_TOKENS, attend_all, config, filled, query
from kvstore.blocks.tierset import SAVED_TIER
from tiers.errors import BlockMissingError, IntegrityError


def flip_byte(store: KVStore, value: bytes, key: bytes | None = None) -> None:
    """Flip one byte in the middle of the saved value ctx/data/<save id of "doc">/<value> (or under `key`)."""
    key = key or b"ctx/data/" + store.saved.reader.read_manifest("doc")["save_id"].encode() + b"/" + value
    with store.saved.values.env.begin(write=True) as txn:
        damaged = bytearray(txn.get(key))
        damaged[len(damaged) // 2] ^= 0x10
        txn.put(key, bytes(damaged))


LAYER_1, PART_0 = (1).to_bytes(2, "big"), (0).to_bytes(4, "big")


@pytest.fixture
def saved(tmp_path):
    """A store (and the outputs of its sequence) whose context 'doc' was saved, the sequence freed."""
    store = KVStore(config(tmp_path / "ssd"))
    seq = filled(store, NUM_TOKENS, seed=21)
    store.save(seq, "doc")
    want = attend_all(store, seq, query(8))
    store.free(seq)
    yield store, want
    store.close()


@pytest.mark.parametrize("value, what", [(b"m/" + LAYER_1 + PART_0, "layer 1's summaries"),
                                         (b"h/" + LAYER_1, "layer 1's summaries"), (b"t", "token ids")])
def test_a_damaged_summary_score_or_token_value_refuses_the_open_and_the_store_holds_nothing(saved, value, what):
    store, _ = saved
    flip_byte(store, value)
    with pytest.raises(IntegrityError, match=f"{what} are damaged"):
        store.open("doc")
    assert not store.sequences and store.stats()["blocks"]["stored"] == 0
    store.check_integrity()


def shorter_by_one_block(layer: dict, block_tokens: int) -> None:
    """A consistent entry one block shorter than the values it names: its summaries hold one row too many."""
    layer["num_blocks"] -= 1
    layer["num_tokens"] -= block_tokens
    layer["dropped"] = [i for i in layer["dropped"] if i < layer["num_blocks"]]
    layer["keyed"] = min(layer["keyed"], layer["num_blocks"])


@pytest.mark.parametrize("damage, message", [
    (shorter_by_one_block, "layer 0's summaries are damaged .* bytes where"),
    (lambda layer, _: layer.update(num_blocks=layer["num_blocks"] - 1), "layer 0's manifest entry is damaged"),
    (lambda layer, _: layer.update(dropped=[layer["num_blocks"]]), "layer 0's manifest entry is damaged"),
    (lambda layer, _: layer.update(dropped=[3, 3]), "layer 0's manifest entry is damaged"),
])
def test_a_manifest_whose_geometry_disagrees_with_its_values_is_refused(saved, damage, message):
    """Refused before the store holds anything: a block count that does not cover the tokens, dropped blocks out
    of range or repeated, or summaries with more (or fewer) bytes than the entry's blocks need (a manifest
    written so, checksum and all: what a writer's mistake would commit)."""
    store, _ = saved
    manifest = store.saved.reader.read_manifest("doc")
    damage(manifest["layers"][0], store.config.block_tokens)
    store.saved.values.put([(b"ctx/name/doc", seal_manifest("doc", manifest))])
    with pytest.raises(IntegrityError, match=message):
        store.open("doc")
    assert not store.sequences and store.stats()["blocks"]["stored"] == 0
    store.check_integrity()


def test_an_opened_context_reads_equal_summaries_and_damaged_sketch_codes_fail_on_first_use(saved):
    store, want = saved
    opened = store.open("doc")
    assert all(torch.equal(a, b) for a, b in zip(attend_all(store, opened, query(8)), want))
    flip_byte(store, b"k/" + LAYER_1 + PART_0)
    with pytest.raises(IntegrityError, match="layer 1's sketch codes are damaged"):
        store.attend(opened, 0, query(8), "sketch", budget=64)
    store.free(opened)
    store.check_integrity()
    assert store.stats()["blocks"]["stored"] == 0


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_a_damaged_or_missing_block_fails_the_attend_that_selects_it_and_the_others_still_read(saved, damage):
    """Blocks are verified one by one where they lie, in the batch a step fetches (tiers/stored.py)."""
    store, want = saved
    opened = store.open("doc")
    index = 40  # a block of layer 1 that stays in the saved tier until selected
    block = store.sequences[opened][1].block_ids[index]
    assert store.tiers.blocks.tier_of[block] == SAVED_TIER
    key = store.tiers.saved.key(block)  # a full block of known ids: its content key (ctx/block/...)
    assert key.startswith(b"ctx/block/")
    if damage == "flip":
        flip_byte(store, b"", key)
    else:
        with store.saved.values.env.begin(write=True) as txn:
            assert txn.delete(key)
    q = query(8)
    assert torch.equal(store.attend(opened, 0, q, "dense", budget=64), want[0])  # layer 0 reads as before
    error, match = (IntegrityError, f"saved block {block}: checksum mismatch") if damage == "flip" else \
        (BlockMissingError, "are gone")
    with pytest.raises(error, match=match):
        store.attend(opened, 1, q, "dense", budget=64)
    assert store.stats()["integrity_errors"] == (damage == "flip")
    store.free(opened)
    store.check_integrity()
