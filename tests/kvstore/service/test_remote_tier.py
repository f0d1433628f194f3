"""The remote tier against a real sidecar: the tier protocol, and KVStore's cold blocks in it."""

from __future__ import annotations

import pytest
import torch

from kvstore import Config, KVStore, ModelSpec
from tiers.remote.client import Client
from tests.kvstore.service.conftest import random_tensor
from tiers.base import IntegrityError
from tiers.layout import BlockLayout
from tiers.quant import dequantize, quantize
from tiers.remote.tier import RemoteTier

LAYOUT = BlockLayout(num_kv_heads=3, block_tokens=16, head_dim=24)


def blocks(n: int, seed: int) -> torch.Tensor:
    return random_tensor(torch.float16, (n, *LAYOUT.shape), seed=seed)  # [n, 2, H, B, D]


def test_tier_protocol_fp16_and_int8(server):
    tier = RemoteTier(LAYOUT, server.url, capacity_bytes=20 * LAYOUT.fp16_bytes)
    x, q = blocks(5, seed=1), quantize(blocks(3, seed=2))
    tier.put([10, 11, 12, 13, 14], x)
    tier.put([20, 21, 22], q)
    assert 12 in tier and 15 not in tier and tier.num_blocks == 8
    assert tier.used_bytes == 5 * LAYOUT.fp16_bytes + 3 * LAYOUT.int8_bytes
    assert tier.free_blocks() == (tier.capacity_bytes - tier.used_bytes) // LAYOUT.fp16_bytes
    assert torch.equal(tier.get([14, 10, 12]), x[[4, 0, 2]])
    got = tier.get([22, 20])
    assert all(torch.equal(a, b) for a, b in zip(got.tensors(), q.index(torch.tensor([2, 0])).tensors()))
    tier.check_integrity()
    mixed = tier.get([10, 20])  # a batch mixing formats comes back fp16, int8 blocks dequantized
    assert torch.equal(mixed[0], x[0]) and torch.equal(mixed[1], dequantize(q.index(slice(0, 1)))[0])
    with pytest.raises(ValueError, match="already stored"):
        tier.put([10], x[:1])
    with pytest.raises(MemoryError):
        tier.put(list(range(100, 115)), blocks(15, seed=3))
    tier.delete([10, 21])
    with pytest.raises(KeyError):
        tier.get([10])
    tier.check_integrity()
    namespace = tier.namespace
    tier.close()
    with Client(server.url) as c:
        assert c.keys(namespace) == []  # a closed tier leaves nothing behind


def test_a_foreign_value_is_an_integrity_error(server):
    tier = RemoteTier(LAYOUT, server.url, capacity_bytes=1 << 20)
    tier.put([1, 2], blocks(2, seed=4))
    with Client(server.url) as c:
        c.put(tier.namespace, f"{2:016x}", torch.zeros(2, 3, 16, 23, dtype=torch.float16) + 1)
    with pytest.raises(IntegrityError, match="expected"):
        tier.get([1, 2])
    assert tier.integrity_errors == 1
    tier.close()


def test_unreachable_or_shared_namespace_is_refused(server):
    with pytest.raises(ValueError, match="no kvtier sidecar"):
        RemoteTier(LAYOUT, "http://127.0.0.1:9", capacity_bytes=1 << 20)
    first = RemoteTier(LAYOUT, server.url, capacity_bytes=1 << 20, namespace="taken")
    first.put([1], blocks(1, seed=5))
    with pytest.raises(ValueError, match="already holds"):
        RemoteTier(LAYOUT, server.url, capacity_bytes=1 << 20, namespace="taken")
    first.close()


def test_kvstore_places_cold_blocks_in_the_sidecar(server):
    spec = ModelSpec(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16)
    config = Config(model=spec, block_tokens=8, sink_tokens=8, hot_tokens=32, warm_tokens=0, gpu_bytes=48 << 10,
                    cpu_bytes=8 << 10, remote_url=server.url, ssd_bytes=64 << 20, device="cpu",
                    host_memory_reserve=0)
    store = KVStore(config)
    g = torch.Generator().manual_seed(6)
    k, v = (torch.randn((700, 2, 16), generator=g).half() for _ in range(2))
    seq = store.create_sequence()
    for layer in range(2):
        store.append(seq, layer, k[:400], v[:400])  # a prefill places old blocks cold at once
        for t in range(400, 700, 60):
            store.append(seq, layer, k[t:t + 60], v[t:t + 60])  # then blocks cool out of the hot window
        store.check_integrity()
    remote = store.tiers.cold
    assert remote.name == "remote" and remote.num_blocks > 100 and store.stats()["tiers"]["cpu"]["blocks"] > 0
    with Client(server.url) as c:
        assert c.stats(remote.namespace)["blocks"] == remote.num_blocks
    for layer in range(2):
        got_k, got_v = store.read(seq, layer)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)  # fp16 all the way: bit-exact
    store.free(seq)
    store.check_integrity()
    assert remote.num_blocks == 0
    store.close()
