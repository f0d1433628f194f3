"""A KVStore whose cold tier is Redis (real servers: tests/tiers/redis_servers.py)."""

from __future__ import annotations

import uuid

import pytest
import torch

from kvstore import Config, KVStore, ModelSpec
from tests.tiers.redis_servers import raw_client
from tests.tiers.redis_servers import redis_cluster, redis_server, redis_single, redis_url  # noqa: F401  (fixtures)
from tiers.base import BlockMissingError
from tiers.quant import within_bound as within_int8

SPEC = ModelSpec(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64)  # 16 KiB blocks of 32 tokens


def config(url: str, **overrides) -> Config:
    base = dict(model=SPEC, block_tokens=32, sink_tokens=32, hot_tokens=64, warm_tokens=64, gpu_bytes=1 << 20,
                cpu_bytes=64 << 10, staging_tokens=64, ssd_bytes=1 << 30, device="cpu", host_memory_reserve=0,
                redis_url=url)
    return Config(**{**base, **overrides})


def kv(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((t, 2, 64), generator=g).half(), torch.randn((t, 2, 64), generator=g).half())


def test_cold_blocks_live_in_redis_and_read_back(redis_url):
    namespace = f"store-{uuid.uuid4().hex[:8]}"
    store = KVStore(config(redis_url, redis_namespace=namespace))
    seq = store.create_sequence()
    k, v = kv(4096, seed=1)
    for start in range(0, 4096, 512):
        store.append(seq, 0, k[start:start + 512], v[start:start + 512])
    tiers = store.stats()["tiers"]
    assert tiers["redis"]["blocks"] > 100 and "ssd" not in tiers, tiers
    got = store.read(seq, 0)
    assert torch.equal(got[0][:32], k[:32]) and torch.equal(got[0][-64:], k[-64:])
    assert within_int8(got, (k, v), 32)
    store.check_integrity()
    raw = raw_client(redis_url)  # on a cluster, scan_iter visits every master
    assert len(list(raw.scan_iter(match=f"{namespace}:*"))) == tiers["redis"]["blocks"]
    store.close()
    assert not list(raw.scan_iter(match=f"{namespace}:*"))  # a store's blocks leave with it
    raw.close()


def test_evicted_cold_blocks_are_a_clean_error_never_data(redis_server):
    server = redis_server("--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru")
    store = KVStore(config(server.url))
    seq = store.create_sequence()
    k, v = kv(8192, seed=2)  # 256 blocks, 4 MiB of cold values in a 3 MiB Redis
    store.append(seq, 0, k, v)
    with pytest.raises(BlockMissingError) as info:
        store.read(seq, 0)
    assert isinstance(info.value, KeyError) and info.value.ids
    q = torch.randn(4, 64).half()
    with pytest.raises(BlockMissingError):
        store.attend(seq, 0, q, mode="dense")
    assert store.stats()["missing_blocks"] == store.tiers.cold.missing_blocks > 0
    store.check_integrity()  # the failed reads changed nothing
    store.free(seq)  # and the sequence can still be freed
    assert store.tiers.cold.num_blocks == 0
    store.check_integrity()
    store.close()


@pytest.mark.parametrize("bad, match", [
    (dict(redis_url="http://cache:6379"), "redis://"),
    (dict(remote_url="http://127.0.0.1:8470"), "set one"),
    (dict(redis_namespace="{tag}"), "redis_namespace"),
    (dict(redis_url=None, redis_namespace="a"), "needs Config.redis_url"),
    (dict(redis_compression="lz4"), "redis_compression"),
])
def test_bad_redis_settings_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        config("redis://127.0.0.1:6379/0", **bad)


def test_unreachable_redis_is_refused_at_open():
    with pytest.raises(ValueError, match="no Redis answers"):
        KVStore(config("redis://127.0.0.1:1/0"))
