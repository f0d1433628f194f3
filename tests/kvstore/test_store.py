"""KVStore: windows, placement across all four tiers, bad input, freeing."""

from __future__ import annotations

import pytest
import torch

from kvstore import CapacityError, Config, KVStore, ModelSpec
from tiers.quant import within_bound as within_int8

SPEC = ModelSpec(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16)


def small_config(tmp_path, **overrides) -> Config:
    base = dict(model=SPEC, block_tokens=8, sink_tokens=8, hot_tokens=32, warm_tokens=64,
                gpu_bytes=48 << 10, cpu_bytes=24 << 10, ssd_path=str(tmp_path / "ssd"), staging_tokens=16,
                ssd_bytes=64 << 20, device="cpu", host_memory_reserve=0)
    return Config(**{**base, **overrides})


def kv(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((t, 2, 16), generator=g).half(), torch.randn((t, 2, 16), generator=g).half())


def test_blocks_cool_through_every_tier_and_read_back(tmp_path):
    store = KVStore(small_config(tmp_path))
    seq = store.create_sequence()
    k, v = kv(1000, seed=1)
    for start in range(0, 1000, 100):
        store.append(seq, 0, k[start:start + 100], v[start:start + 100])
        store.check_integrity()
    tiers = store.stats()["tiers"]
    assert all(tiers[name]["blocks"] > 0 for name in ("hot", "warm", "cpu", "ssd")), tiers
    got_k, got_v = store.read(seq, 0)
    # Sinks and the recent window never left fp16; everything older went through int8.
    assert torch.equal(got_k[:8], k[:8]) and torch.equal(got_k[-32:], k[-32:])
    assert within_int8((got_k, got_v), (k, v), 8)
    store.close()


def test_decode_appends_match_one_prefill(tmp_path):
    a, b = KVStore(small_config(tmp_path / "a")), KVStore(small_config(tmp_path / "b"))
    k, v = kv(300, seed=2)
    sa, sb = a.create_sequence(), b.create_sequence()
    a.append(sa, 1, k, v)
    for t in range(300):
        b.append(sb, 1, k[t:t + 1], v[t:t + 1])
    # Decode steps pass old blocks through int8 (warm); a prefill places them cold directly.
    got_a, got_b = a.read(sa, 1), b.read(sb, 1)
    assert torch.equal(got_a[0][-32:], got_b[0][-32:]) and torch.equal(got_a[0][:8], got_b[0][:8])
    assert within_int8(got_a, (k, v), 8) and within_int8(got_b, (k, v), 8)
    assert torch.equal(a.sequences[sa][1].summaries[:38], b.sequences[sb][1].summaries[:38])
    a.close(), b.close()


def test_summaries_are_min_and_max_of_keys(tmp_path):
    store = KVStore(small_config(tmp_path))
    seq = store.create_sequence()
    k, v = kv(45, seed=3)
    store.append(seq, 0, k[:20], v[:20])
    store.append(seq, 0, k[20:], v[20:])
    summaries = store.sequences[seq][0].summaries
    for i in range(6):
        block = k[i * 8:(i + 1) * 8]
        assert torch.equal(summaries[i, 0], block.amin(0)) and torch.equal(summaries[i, 1], block.amax(0))
    store.close()


def test_read_ranges(tmp_path):
    store = KVStore(small_config(tmp_path))
    seq = store.create_sequence()
    k, v = kv(333, seed=4)
    store.append(seq, 0, k, v)
    full_k, full_v = store.read(seq, 0)
    for start, end in [(0, 0), (5, 6), (7, 17), (100, 333), (332, 333)]:
        part_k, part_v = store.read(seq, 0, start, end)
        assert torch.equal(part_k, full_k[start:end]) and torch.equal(part_v, full_v[start:end])
    store.close()


@pytest.mark.parametrize("bad, match", [
    (lambda s, q: s.append(q, 0, *[x.float() for x in kv(4, 0)]), "float16"),
    (lambda s, q: s.append(q, 0, torch.zeros(4, 3, 16).half(), torch.zeros(4, 3, 16).half()), r"\[T>0, 2, 16\]"),
    (lambda s, q: s.append(q, 0, *kv(0, 0)), "T>0"),
    (lambda s, q: s.append(q, 0, kv(4, 0)[0], kv(5, 0)[1]), "same shape"),
    (lambda s, q: s.append(q, 2, *kv(4, 0)), "layer"),
    (lambda s, q: s.append(q + 7, 0, *kv(4, 0)), "unknown sequence"),
    (lambda s, q: s.read(q, 0, 5, 2), "start"),
    (lambda s, q: s.read(q, 0, 0, 999), "end"),
])
def test_bad_input_is_refused_and_changes_nothing(tmp_path, bad, match):
    store = KVStore(small_config(tmp_path))
    seq = store.create_sequence()
    store.append(seq, 0, *kv(50, seed=5))
    before = store.stats(), store.read(seq, 0)
    with pytest.raises((ValueError, KeyError), match=match):
        bad(store, seq)
    after = store.stats(), store.read(seq, 0)
    assert before[0] == after[0] and all(torch.equal(x, y) for x, y in zip(before[1], after[1]))
    store.check_integrity()
    store.close()


def test_freed_sequence_is_unknown(tmp_path):
    store = KVStore(small_config(tmp_path))
    seq = store.create_sequence()
    store.append(seq, 0, *kv(500, seed=6))
    store.free(seq)
    with pytest.raises(KeyError, match="unknown sequence"):
        store.read(seq, 0)
    with pytest.raises(KeyError):
        store.free(seq)
    assert all(t["blocks"] == 0 for t in store.stats()["tiers"].values())
    store.check_integrity()
    store.close()


@pytest.mark.parametrize("overrides, match", [
    (dict(gpu_bytes=1 << 10), "gpu_bytes"),
    (dict(block_tokens=12), "power of two"),
    (dict(hot_tokens=4), "hot_tokens"),
    (dict(cpu_dtype="fp8"), "cpu_dtype"),
    (dict(eager_graphs=1), "eager_graphs must be True or False"),
    (dict(device="cuda:0") if not torch.cuda.is_available() else dict(block_tokens=0), "device|power"),
])
def test_bad_config_is_a_clear_error(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        KVStore(small_config(tmp_path, **overrides))


def test_full_store_refuses_append_and_changes_nothing(tmp_path):
    store = KVStore(small_config(tmp_path, ssd_bytes=8 << 10))
    seq = store.create_sequence()
    store.append(seq, 0, *kv(200, seed=7))
    before = store.stats()
    with pytest.raises(CapacityError):
        store.append(seq, 0, *kv(4000, seed=8))
    assert store.stats() == before
    store.check_integrity()
    store.close()


def test_gpu_pressure_cools_other_sequences_first_come(tmp_path):
    store = KVStore(small_config(tmp_path, hot_tokens=64, warm_tokens=0, gpu_bytes=26 << 10))
    seqs = [store.create_sequence() for _ in range(3)]
    data = {s: kv(300, seed=10 + s) for s in seqs}
    for s in seqs:
        store.append(s, 0, *data[s])
        store.check_integrity()
    for s in seqs:
        got_k, _ = store.read(s, 0)
        assert torch.equal(got_k[-8:], data[s][0][-8:])  # the tail stays exact and hot
    store.close()
