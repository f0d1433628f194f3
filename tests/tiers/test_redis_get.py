"""The redis tier's get, whose values are received straight into the batch (tiers/redis_batch.py):
an error mid-batch leaves no reply behind on the connection, raw and compressed values mix, rows
arrive in any order from a cluster's masters, and a slot moved under the client is followed."""

from __future__ import annotations

import uuid

import pytest
import torch
from redis.crc import key_slot

from bench_longctx.redis_servers import RedisCluster
from tests.tiers.redis_servers import raw_client, require_redis
from tiers.base import BlockMissingError, IntegrityError
from tiers.layout import BlockLayout
from tiers.redis import RedisTier

LAYOUT = BlockLayout(num_kv_heads=2, block_tokens=32, head_dim=64)  # 16 KiB fp16 blocks


def kv_like(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((n, *LAYOUT.shape), generator=g) * 3).half()  # [n, 2, H, B, D]


def test_an_error_mid_batch_leaves_the_connection_clean(redis_url):
    tier = RedisTier(LAYOUT, redis_url, 1 << 26)
    tier.get_window_blocks = 2  # several windows in flight: the error comes before most replies are read
    x = kv_like(9, seed=1)
    ids = list(range(9))
    tier.put(ids, x)
    raw = raw_client(redis_url)
    good = raw.get(tier.key(2))
    raw.set(tier.key(2), good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(IntegrityError, match="checksum"):
        tier.get(ids)
    assert torch.equal(tier.get(ids[3:]), x[3:])  # no reply of the failed get is read as one of these
    raw.set(tier.key(2), good)
    raw.delete(tier.key(4))
    with pytest.raises(BlockMissingError) as info:
        tier.get(ids)
    assert info.value.ids == [4]
    assert torch.equal(tier.get([8, 0, 5]), x[[8, 0, 5]])
    assert tier.integrity_errors == 1 and tier.missing_blocks == 1
    tier.close()
    raw.close()


def test_raw_and_compressed_values_mix_in_one_batch(redis_url):
    namespace = f"test-mix-{uuid.uuid4().hex[:8]}"
    x = kv_like(4, seed=2)
    zstd = RedisTier(LAYOUT, redis_url, 1 << 26, namespace=namespace, shared=True, compression="zstd")
    plain = RedisTier(LAYOUT, redis_url, 1 << 26, namespace=namespace, shared=True)
    zstd.put([1, 2], x[:2])
    plain.put([3, 4], x[2:])
    reader = RedisTier(LAYOUT, redis_url, 1 << 26, namespace=namespace, shared=True)
    reader.attach([1, 2, 3, 4])
    assert reader.sizes[1] < reader.sizes[3] == LAYOUT.fp16_bytes + reader.value_overhead  # compressed, raw
    assert torch.equal(reader.get([3, 1, 4, 2]), x[[2, 0, 3, 1]])
    raw = raw_client(redis_url)
    raw.delete(*(reader.key(i) for i in range(1, 5)))
    raw.close()
    for tier in (zstd, plain, reader):
        tier.close()


def test_a_cluster_get_in_any_order(redis_cluster):
    tier = RedisTier(LAYOUT, redis_cluster.url, 1 << 26)
    tier.get_window_blocks = 3
    x = kv_like(40, seed=3)
    tier.put(list(range(40)), x)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(0)).tolist()
    assert torch.equal(tier.get(order), x[order])
    tier.close()


def test_a_slot_moved_under_the_client_is_followed(tmp_path):
    require_redis()
    cluster = RedisCluster(str(tmp_path / "cluster"))
    try:
        tier = RedisTier(LAYOUT, cluster.url, 1 << 26)
        x = kv_like(12, seed=4)
        tier.put(list(range(12)), x)
        key = tier.key(5)
        source = next(n for n in cluster.nodes if n.port == tier.client.get_node_from_key(key).port)
        target = next(n for n in cluster.nodes if n is not source)
        _move_slot(key_slot(key), source, target, cluster.nodes)
        assert torch.equal(tier.get(list(range(12))), x)  # the tier's client still maps the slot to source
        tier.close()
    finally:
        cluster.stop()


def _move_slot(slot: int, source, target, nodes) -> None:
    """Redis Cluster's resharding steps for one slot: mark it, migrate its keys, hand it over."""
    with source.client() as src, target.client() as dst:
        src_id, dst_id = src.execute_command("CLUSTER", "MYID"), dst.execute_command("CLUSTER", "MYID")
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
    for node in nodes:
        with node.client() as c:
            c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
