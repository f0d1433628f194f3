"""Two gloo processes save a sharded sequence (each rank its shard, each store its copy of the manifest), free it,
and open it in new stores over the same paths: the opened sequence appends and attends bit-equal to the one never
saved, in every mode. A damaged shard is refused on every rank (IntegrityError), a group of another size is
refused before anything opens (ValueError), and a delete takes the manifest and the rank's shard."""

from __future__ import annotations

import pytest
import torch

from kvstore.parallel.group import RankGroup, spawn
from kvstore.parallel.saved import delete_sharded, open_sharded, read_sharded, save_sharded, shard_name
from kvstore.parallel.sequence import ShardedSequence
from kvstore.parallel.shards import ShardPlan
from tests.kvstore.parallel.test_sharded_sequence import MODES, queries
from tests.kvstore.parallel.test_shards import SPEC, make_store, random_kv
from tiers.errors import IntegrityError

PREFILL, APPENDS, STEPS, BUDGET = 250, 5, 4, 96


def decode(sharded: ShardedSequence, k: torch.Tensor, v: torch.Tensor, first: int, steps: int) -> list[torch.Tensor]:
    """Append the tokens at positions [first, first + steps), attending in every mode after each."""
    outs = []
    for pos in range(first, first + steps):
        for layer in range(SPEC.num_layers):
            sharded.append(layer, k[pos: pos + 1], v[pos: pos + 1])
        outs += [sharded.attend(layer, queries(pos), m, BUDGET) for layer in range(SPEC.num_layers) for m in MODES]
    return outs


def flip_summary_byte(store, name: str) -> None:
    """Flip one byte in the middle of layer 1's key summaries in the save `name` (as the contexts tests do)."""
    save_id = store.saved.reader.read_manifest(name)["save_id"]
    key = b"ctx/data/" + save_id.encode() + b"/m/" + (1).to_bytes(2, "big") + (0).to_bytes(4, "big")
    with store.saved.values.env.begin(write=True) as txn:
        damaged = bytearray(txn.get(key))
        damaged[len(damaged) // 2] ^= 0x10
        txn.put(key, bytes(damaged))


def run_rank(group: RankGroup, root: str) -> dict:
    path = f"{root}/rank{group.rank}"  # one live store per ssd_path: each rank its own
    k, v = random_kv(PREFILL + APPENDS + STEPS, SPEC, 7)
    with make_store(hot_tokens=512, ssd_path=path) as store:
        sharded = ShardedSequence(store, group, ShardPlan.split(PREFILL, group.world_size, 16))
        for layer in range(SPEC.num_layers):
            sharded.fill(layer, k[:PREFILL], v[:PREFILL])
        decode(sharded, k, v, PREFILL, APPENDS)  # attends too: H2O scores to save
        save_sharded(sharded, "doc")
        want = decode(sharded, k, v, PREFILL + APPENDS, STEPS)
        store.free(sharded.seq)
    with make_store(hot_tokens=512, ssd_path=path) as store:
        opened = open_sharded(store, group, "doc")
        got = decode(opened, k, v, PREFILL + APPENDS, STEPS)
        held = store.table(opened.seq, 0).num_tokens
        store.check_integrity()
        store.free(opened.seq)
        if group.rank == 1:
            flip_summary_byte(store, shard_name("doc", 1, 2))
        with pytest.raises(IntegrityError) as damaged:
            open_sharded(store, group, "doc")
        left = len(store.sequences)
    return {"equal": all(torch.equal(a, b) for a, b in zip(want, got)), "num_outs": len(got), "held": held,
            "lengths": opened.lengths, "damaged": str(damaged.value), "left": left, "out": got[-1]}


def test_two_ranks_save_and_open_a_sharded_sequence_that_decodes_bit_equal(tmp_path) -> None:
    ranks = spawn(run_rank, 2, "gloo", str(tmp_path))
    for r in ranks:
        assert r["equal"] and r["num_outs"] == STEPS * SPEC.num_layers * len(MODES)
        assert r["lengths"] == [PREFILL + APPENDS + STEPS] * SPEC.num_layers
        assert r["left"] == 0  # the refused open left nothing opened
        assert torch.equal(r["out"], ranks[0]["out"])
    assert [r["held"] for r in ranks] == [128, PREFILL + APPENDS + STEPS - 128]  # 16 blocks: 8, 8 and the appends
    assert "layer 1's summaries are damaged" in ranks[1]["damaged"]  # the damaged shard's own error
    assert "rank 1 could not open its shard" in ranks[0]["damaged"]  # its peer: the same class, naming rank 1

    with make_store(ssd_path=str(tmp_path / "rank0")) as store:
        manifest = read_sharded(store, "doc")
        assert manifest["world_size"] == 2 and manifest["starts"] == [0, 8]
        assert [s["num_tokens"] for s in manifest["shards"]] == [[128, 128], [PREFILL + APPENDS - 128] * 2]
        with pytest.raises(ValueError, match="saved over 2 ranks; this group has 1"):
            open_sharded(store, RankGroup(), "doc")
        assert not store.sequences
        assert store.saved_contexts() == ["doc:rank0-of2"]
        delete_sharded(store, RankGroup(0, 2), "doc")  # rank 0's part (no collective)
        assert store.saved_contexts() == []
        with pytest.raises(KeyError, match="no sharded context named 'doc'"):
            read_sharded(store, "doc")
        store.check_integrity()
