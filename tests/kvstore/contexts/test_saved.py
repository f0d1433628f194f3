"""Saved contexts: save, open in another process (lazily, outputs equal), atomic under kill -9."""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import torch

from kvstore import Config, KVStore, ModelSpec

SPEC = ModelSpec(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16)
NUM_TOKENS = 1203  # 150 full blocks and a 3-token tail per layer
REPO = Path(__file__).resolve().parents[3]


def config(path: str, **overrides) -> Config:
    base = dict(model=SPEC, block_tokens=8, sink_tokens=8, hot_tokens=32, warm_tokens=0, gpu_bytes=96 << 10,
                cpu_bytes=48 << 10, ssd_path=str(path), staging_tokens=256, ssd_bytes=64 << 20, device="cpu",
                host_memory_reserve=0, model_id="test-model")
    return Config(**{**base, **overrides})


def opened_config(path: str, warm_tokens: int) -> Config:
    """The store of the equal-outputs test: with a warm window, the cpu tier holds int8 too, so cooling never
    changes a block's format (warm int8 -> cpu fp16 would dequantize; the writer's and the reader's tiers fill
    differently, so a block could then be read as int8 by one and as fp16 by the other)."""
    return config(path, warm_tokens=warm_tokens, cpu_dtype="int8" if warm_tokens else "float16")


def kv(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn((t, 2, 16), generator=g)
    k[:, :, :4] *= 4  # outlier channels: blocks differ in their summaries, so topk selects
    return k.half(), torch.randn((t, 2, 16), generator=g).half()


def filled(store: KVStore, num_tokens: int, seed: int) -> int:
    """A sequence whose blocks end up in every tier: hot, warm (int8), cpu and ssd."""
    seq = store.create_sequence()
    store.extend_tokens(seq, [(seed * 7 + i) % 1000 for i in range(num_tokens)])
    for layer in range(SPEC.num_layers):
        k, v = kv(num_tokens, seed + layer)
        for lo in range(0, num_tokens, 100):
            store.append(seq, layer, k[lo:lo + 100], v[lo:lo + 100])
    return seq


def query(seed: int) -> torch.Tensor:
    return torch.randn((SPEC.num_q_heads, SPEC.head_dim), generator=torch.Generator().manual_seed(seed)).half()


def attend_all(store: KVStore, seq: int, q: torch.Tensor) -> list[torch.Tensor]:
    """Dense (more blocks than staging holds: temporary pools) and top-K within staging (128 tokens: the warm
    window's int8 blocks among those staged)."""
    return [store.attend(seq, layer, q, mode, budget=budget) for layer in range(SPEC.num_layers)
            for mode, budget in (("dense", 64), ("topk", 64), ("topk", 128))]


@contextmanager
def second_write_fails(store: KVStore) -> Iterator[None]:
    """The save's second batch of block values raises OSError (the disk went away), inside the block."""
    encode, calls = store.saved.blocks.encode, []

    def failing(*args):
        calls.append(args)
        if len(calls) == 2:
            raise OSError("disk went away")
        return encode(*args)

    store.saved.blocks.encode = failing
    try:
        yield
    finally:
        store.saved.blocks.encode = encode


def worker(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.kvstore.contexts.saved_worker", *map(str, args)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True, **kw)


@pytest.mark.parametrize("warm_tokens", [0, 64])
def test_a_saved_context_opens_in_another_process_with_equal_outputs(tmp_path, warm_tokens):
    """Bit-equal, warm int8 blocks included: the opened sequence stages each block in the format it was saved
    in (kvstore/decode/staging.py), so the kernel reads the original's warm blocks as int8 too."""
    path = tmp_path / "ssd"
    store = KVStore(opened_config(path, warm_tokens))
    seq = filled(store, NUM_TOKENS, seed=3)
    tiers = store.stats()["tiers"]
    assert all(tiers[t]["blocks"] for t in ("hot", "cpu", "ssd") + (("warm",) if warm_tokens else ())), tiers
    store.save(seq, "doc")
    want = attend_all(store, seq, query(1))  # after the save: attending promotes blocks, saving must not
    assert store.saved_contexts() == ["doc"]
    store.close()
    proc = worker("open", path, "doc", tmp_path / "out.pt", warm_tokens)
    assert proc.wait(timeout=120) == 0
    got = torch.load(tmp_path / "out.pt")
    for a, b in zip(got["outs"], want):
        assert torch.equal(a, b)
    assert got["stats"]["attend"]["cold_blocks_fetched"] > 0  # blocks came from the saved values


def test_open_is_lazy_and_the_opened_sequence_lives_on(tmp_path):
    store = KVStore(config(tmp_path / "ssd"))
    seq = filled(store, NUM_TOKENS, seed=4)
    ids = store.token_ids(seq)
    store.save(seq, "doc")
    q = query(2)
    want = attend_all(store, seq, q)
    store.free(seq)
    opened = store.open("doc")
    store.check_integrity()
    stats = store.stats()["tiers"]
    loaded = SPEC.num_layers * (1 + 5)  # per layer: the sink block and the 5 blocks the hot window touches (tail too)
    assert stats["saved"]["blocks"] == SPEC.num_layers * 151 - loaded  # nothing else was read
    assert store.stats()["blocks"]["stored"] == SPEC.num_layers * 151
    assert store.token_ids(opened) == ids
    fetched = store.stats()["attend"]["cold_blocks_fetched"]
    topk = store.attend(opened, 0, q, "topk", budget=64)
    read = store.stats()["attend"]["cold_blocks_fetched"] - fetched  # only selected blocks: 8 a kv head, of 151
    assert 0 < read <= SPEC.num_kv_heads * 64 // 8
    assert torch.equal(topk, want[1])
    assert all(torch.equal(a, b) for a, b in zip(attend_all(store, opened, q), want))
    match = store.match_prefix(ids[:500])
    assert match.num_tokens == 496  # the opened blocks carry content keys: prefixes can start on them
    fork = store.fork(opened)
    store.extend_tokens(opened, [1, 2])
    for layer in range(SPEC.num_layers):  # the opened sequence grows; its saved tail is copy-on-write
        store.append(opened, layer, *kv(2, 40 + layer))
    store.check_integrity()
    for seq in (opened, fork):
        store.free(seq)
    store.check_integrity()
    assert store.stats()["blocks"]["stored"] == 0 and store.stats()["tiers"]["saved"]["blocks"] == 0
    again = store.open("doc")  # freeing never touched the saved values
    assert all(torch.equal(a, b) for a, b in zip(attend_all(store, again, q), want))
    store.save(again, "copy")  # a context opened lazily saves again (values copied as stored)
    store.delete_saved("doc")
    assert store.saved_contexts() == ["copy"]
    assert all(torch.equal(a, b) for a, b in zip(attend_all(store, store.open("copy"), q), want))
    store.close()


def test_open_reads_summaries_not_sketches_and_the_sketch_loads_on_first_use(tmp_path):
    store = KVStore(config(tmp_path / "ssd"))
    seq = filled(store, NUM_TOKENS, seed=11)
    store.save(seq, "doc")
    q = query(6)
    want = [store.attend(seq, layer, q, "sketch", budget=64) for layer in range(SPEC.num_layers)]
    codes = [store.sequences[seq][layer].sketch[:151].clone() for layer in range(SPEC.num_layers)]
    store.free(seq)
    read = value_reads(store)
    opened = store.open("doc")
    sketch_keys = [k for k in read if b"/k/" in k]
    assert not sketch_keys and any(b"/m/" in k for k in read)  # summaries yes, sketch codes no
    store.attend(opened, 0, q, "topk", budget=64)
    assert opened in store.unread and not [k for k in read if b"/k/" in k]
    fork = store.fork(opened)  # the fork's codes are unloaded too, and load on their own
    got = [store.attend(opened, layer, q, "sketch", budget=64) for layer in range(SPEC.num_layers)]
    assert [k for k in read if b"/k/" in k] and opened not in store.unread
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for layer in range(SPEC.num_layers):
        assert torch.equal(store.sequences[opened][layer].sketch[:150], codes[layer][:150])
    assert fork in store.unread
    assert all(torch.equal(store.attend(fork, layer, q, "sketch", budget=64), want[layer])
               for layer in range(SPEC.num_layers))
    store.check_integrity()
    store.close()


def value_reads(store: KVStore, kind: bytes = b"/") -> list[bytes]:
    """Keys of the values (those of one kind: b"/k/" sketch codes, b"/m/" summaries) the store reads from its
    saved contexts from now on, copied (get) or in place (view)."""
    read, values = [], store.saved.values
    get, view = values.get, values.view
    values.get = lambda keys: read.extend(k for k in keys if kind in k) or get(keys)
    values.view = lambda keys, use: read.extend(k for k in keys if kind in k) or view(keys, use)
    return read


def code_reads(store: KVStore) -> list[bytes]:
    """Keys of the sketch-code values the store reads from its saved contexts from now on."""
    return value_reads(store, b"/k/")


def test_a_prefix_of_an_opened_context_and_a_save_of_it_leave_its_sketch_codes_unread(tmp_path):
    store = KVStore(config(tmp_path / "ssd"))
    seq = filled(store, NUM_TOKENS, seed=12)
    ids = store.token_ids(seq)
    store.save(seq, "doc")
    q = query(7)
    want = [store.attend(seq, layer, q, "sketch", budget=64) for layer in range(SPEC.num_layers)]
    ref = store.create_sequence(store.match_prefix(ids[:600]))
    want_prefix = [store.attend(ref, layer, q, "sketch", budget=64) for layer in range(SPEC.num_layers)]
    store.free(seq)
    store.free(ref)
    read = code_reads(store)
    opened = store.open("doc")
    prefix = store.create_sequence(store.match_prefix(ids[:600]))  # 75 blocks shared with the opened sequence
    assert store.table(prefix, 0).num_tokens == 600 and not read
    assert opened in store.unread and prefix in store.unread
    store.save(opened, "copy")  # its codes go from the save to the new save, not through its tables
    assert opened in store.unread and not any(store.table(opened, layer).sketch[:151].any()
                                              for layer in range(SPEC.num_layers))
    assert read and len(read) == len(set(read))  # each saved part of the codes read once
    read.clear()
    got = [store.attend(prefix, layer, q, "sketch", budget=64) for layer in range(SPEC.num_layers)]
    assert all(torch.equal(a, b) for a, b in zip(got, want_prefix))
    assert read and prefix not in store.unread and opened in store.unread  # the prefix read only its own
    copy = store.open("copy")
    for s in (copy, opened):
        assert all(torch.equal(store.attend(s, layer, q, "sketch", budget=64), want[layer])
                   for layer in range(SPEC.num_layers))
    store.check_integrity()
    store.close()


def test_a_grown_opened_context_saves_its_refilled_tail_codes_and_the_rest_from_its_save(tmp_path):
    """The saved partial tail fills after open: its codes are re-encoded in the table, the others unread."""
    store = KVStore(config(tmp_path / "ssd"))
    seq = filled(store, NUM_TOKENS, seed=13)
    store.save(seq, "doc")
    grow = [kv(5, 50 + layer) for layer in range(SPEC.num_layers)]  # 1203 + 5: the 151st block is full
    for layer in range(SPEC.num_layers):
        store.append(seq, layer, *grow[layer])
    want = [store.table(seq, layer).sketch[:151].clone() for layer in range(SPEC.num_layers)]
    store.free(seq)
    opened = store.open("doc")
    for layer in range(SPEC.num_layers):
        store.append(opened, layer, *grow[layer])
    store.save(opened, "grown")
    assert opened in store.unread
    grown = store.open("grown")
    for s in (grown, opened):
        store.unread.load_if_needed(s)
        assert all(torch.equal(store.table(s, layer).sketch[:151], want[layer]) for layer in range(SPEC.num_layers))
    store.check_integrity()
    store.close()


def test_open_refuses_another_model_and_unknown_names(tmp_path):
    store = KVStore(config(tmp_path / "ssd"))
    store.save(filled(store, 100, seed=5), "doc")
    store.close()
    other = KVStore(config(tmp_path / "ssd", model_id="another-model"))
    with pytest.raises(ValueError, match="another model"):
        other.open("doc")
    with pytest.raises(KeyError, match="no saved context"):
        other.open("nothing")
    with pytest.raises(ValueError, match="name must match"):
        other.save(other.create_sequence(), "bad/name")
    assert other.saved_contexts() == ["doc"]  # reopening the path swept stale blocks, not saved contexts
    other.close()


def continue_decoding(store: KVStore, seq: int, steps: int) -> list[torch.Tensor]:
    """`steps` more tokens (K/V appended to every layer, id recorded), attending after each."""
    outs = []
    for step in range(steps):
        store.extend_tokens(seq, [500 + step])
        for layer in range(SPEC.num_layers):
            store.append(seq, layer, *kv(1, seed=1000 + 10 * step + layer))
        outs += attend_all(store, seq, query(100 + step))
    return outs


def test_an_opened_context_decodes_step_after_step_what_the_writer_did(tmp_path):
    """Beyond the first step: the writer had fetched and promoted blocks before it saved, the reader starts with no
    fetch history, so they promote and stage at other steps; with cold tiers holding int8 (no block changes format)
    their outputs stay bit-equal token after token, blocks cooling out of the windows included."""
    path = tmp_path / "ssd"
    with KVStore(opened_config(path, 64)) as writer:
        seq = filled(writer, NUM_TOKENS, seed=5)
        for _ in range(3):
            attend_all(writer, seq, query(9))  # fetch history: repeatedly selected cold blocks are promoted
        assert writer.stats()["attend"]["promotions"] > 0
        writer.save(seq, "doc")
        want = continue_decoding(writer, seq, 40)  # 5 blocks of new tokens: blocks leave the hot window
    with KVStore(opened_config(path, 64)) as reader:
        got = continue_decoding(reader, reader.open("doc"), 40)
        assert reader.stats()["attend"]["cold_blocks_fetched"] > 0
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
