"""One 1M-token sequence of a small geometry through all four tiers and back."""

from __future__ import annotations

import torch

from kvstore import Config, KVStore, ModelSpec
from tiers.quant import within_bound as within_int8

TOKENS = 1 << 20
CHUNK = 1 << 16


def test_million_token_sequence_round_trips(tmp_path):
    spec = ModelSpec(num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=64)
    store = KVStore(Config(
        model=spec, block_tokens=32, sink_tokens=64, hot_tokens=4096, warm_tokens=32768,
        gpu_bytes=8 << 20, cpu_bytes=64 << 20, ssd_path=str(tmp_path / "ssd"), ssd_bytes=1 << 30,
        device="cpu", host_memory_reserve=0,
    ))
    seq = store.create_sequence()
    g = torch.Generator().manual_seed(0)
    k = torch.randn((TOKENS, 1, 64), generator=g).half()
    v = torch.randn((TOKENS, 1, 64), generator=g).half()
    for start in range(0, TOKENS, CHUNK):
        store.append(seq, 0, k[start:start + CHUNK], v[start:start + CHUNK])
    for t in range(TOKENS, TOKENS + 40):  # a few decode steps on top
        store.append(seq, 0, k[t % 1000:t % 1000 + 1], v[t % 1000:t % 1000 + 1])
    store.check_integrity()
    tiers = store.stats()["tiers"]
    assert all(tiers[name]["blocks"] > 0 for name in ("hot", "warm", "cpu", "ssd")), tiers  # saved: opened contexts
    assert sum(t["blocks"] for t in tiers.values()) == -(-(TOKENS + 40) // 32)
    want_k = torch.cat([k, k[TOKENS % 1000:][:40]])
    want_v = torch.cat([v, v[TOKENS % 1000:][:40]])
    got_k, got_v = store.read(seq, 0)
    assert within_int8((got_k, got_v), (want_k, want_v), 32)
    assert torch.equal(got_k[:64], want_k[:64]) and torch.equal(got_k[-4096:], want_k[-4096:])
    store.free(seq)
    store.check_integrity()
    assert store.tiers.cold._scan() == {}
    store.close()
