"""The redis tier against real servers: damage is never served, eviction is a clean miss, a
killed server loses nothing acknowledged under appendfsync always, processes share blocks."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import threading
import uuid

import pytest
import torch

from bench_longctx.redis_servers import RedisCluster
from tests.tiers.redis_servers import raw_client, require_redis
from tiers.base import BlockMissingError, IntegrityError
from tiers.layout import BlockLayout
from tiers.quant import dequantize, quantize
from tiers.redis import RedisTier

LAYOUT = BlockLayout(num_kv_heads=2, block_tokens=32, head_dim=64)  # 16 KiB fp16 blocks


def kv_like(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *LAYOUT.shape), generator=g)
    x[:, 0, :, :, :4] *= 30  # a few large key channels, as real keys have
    return x.half()


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_bit_flips_are_never_served(redis_url, compression):
    tier = RedisTier(LAYOUT, redis_url, 1 << 26, compression=compression)
    x = kv_like(2, seed=1)
    tier.put([1, 2], x)
    key, raw = tier.key(1), raw_client(redis_url)
    good = raw.get(key)
    rng = random.Random(0)
    # Every part of the value: envelope, key, codec header, payload, the last byte.
    positions = [0, 5, 14, 20, 14 + len(key) + 10, len(good) // 2, len(good) - 1]
    positions += [rng.randrange(len(good)) for _ in range(60)]
    served = 0
    for pos in positions:
        bad = bytearray(good)
        bad[pos] ^= 1 << rng.randrange(8)
        raw.set(key, bytes(bad))
        try:
            tier.get([2, 1])
            served += 1
        except IntegrityError:
            pass
    assert served == 0 and tier.integrity_errors == len(positions)
    assert torch.equal(tier.get([2]), x[1:])  # the intact block still reads
    raw.set(key, good)
    assert torch.equal(tier.get([1, 2]), x)
    tier.close()
    raw.close()


def test_truncated_foreign_and_moved_values_raise(redis_url):
    tier = RedisTier(LAYOUT, redis_url, 1 << 26)
    x = kv_like(2, seed=2)
    tier.put([1, 2], x)
    raw = raw_client(redis_url)
    good = raw.get(tier.key(1))
    bad_values = [good[:n] for n in (0, 10, 14 + len(tier.key(1)), 100, len(good) - 1)]
    bad_values.append(raw.get(tier.key(2)))  # block 2's value under block 1's key
    other = RedisTier(LAYOUT, redis_url, 1 << 26)  # same id, another namespace
    other.put([1], x[:1])
    bad_values.append(raw.get(other.key(1)))
    for value in bad_values:
        raw.set(tier.key(1), value)
        with pytest.raises(IntegrityError):
            tier.get([1])
    raw.delete(tier.key(1))
    raw.hset(tier.key(1), "field", b"x")  # another type under the key
    with pytest.raises(IntegrityError):
        tier.get([1])
    assert tier.integrity_errors == len(bad_values) + 1
    raw.delete(tier.key(1))
    for t in (tier, other):
        t.close()
    raw.close()


def test_evicted_keys_are_a_clean_miss(redis_server):
    server = redis_server("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
    tier = RedisTier(LAYOUT, server.url, 1 << 30)
    x = kv_like(16, seed=3)
    for start in range(0, 512, 16):  # 8 MiB of values through a 2 MiB Redis
        tier.put(list(range(start, start + 16)), x)
    assert tier.num_blocks == 512
    gone = []
    for block_id in range(512):
        try:
            assert torch.equal(tier.get([block_id]), x[block_id % 16: block_id % 16 + 1])
        except BlockMissingError as exc:
            assert isinstance(exc, KeyError) and exc.ids == [block_id]
            gone.append(block_id)
    assert 0 in gone and len(gone) > 256  # most are evicted, the newest survive
    with pytest.raises(BlockMissingError, match="evicted") as info:
        tier.get(list(range(512)))
    assert set(gone) <= set(info.value.ids)  # an evicted block never comes back
    assert tier.missing_blocks == len(gone) + len(info.value.ids)
    tier.check_integrity()
    tier.delete(list(range(512)))  # deleting evicted blocks is no error
    assert tier.num_blocks == 0 and tier.used_bytes == 0
    tier.close()


def test_full_redis_refuses_a_put_and_keeps_nothing_of_it(redis_server):
    server = redis_server("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    tier = RedisTier(LAYOUT, server.url, 1 << 30)
    x = kv_like(16, seed=4)
    with pytest.raises(MemoryError, match="out of memory"):
        for start in range(0, 512, 16):
            tier.put(list(range(start, start + 16)), x)
    stored = tier.num_blocks
    with server.client() as raw:
        assert raw.dbsize() == stored > 0  # the refused batch left no key behind
    tier.check_integrity()
    tier.close()


def test_kill_mid_batch_loses_nothing_acknowledged(redis_server):
    server = redis_server("--appendonly", "yes", "--appendfsync", "always")
    tier = RedisTier(LAYOUT, server.url, 1 << 34, timeout=10)
    x = kv_like(64, seed=5)  # 1 MiB per batch
    acknowledged: list[int] = []
    failures: list[BaseException] = []
    enough = threading.Event()

    def writer() -> None:
        start = 0
        try:
            while True:
                tier.put(list(range(start, start + 64)), x)
                acknowledged.extend(range(start, start + 64))
                start += 64
                if start >= 64 * 20:
                    enough.set()
        except BaseException as exc:  # the test asserts its type below
            failures.append(exc)
            enough.set()

    thread = threading.Thread(target=writer)
    thread.start()
    assert enough.wait(120)
    server.kill()
    thread.join(60)
    assert not thread.is_alive()
    assert len(failures) == 1 and isinstance(failures[0], ConnectionError), failures
    assert tier.num_blocks == len(acknowledged) >= 64 * 20  # the failed batch is not recorded
    with pytest.raises(ConnectionError):
        tier.get(acknowledged[:4])
    server.start()  # same directory: the AOF is replayed
    for start in range(0, len(acknowledged), 256):
        ids = acknowledged[start:start + 256]
        assert torch.equal(tier.get(ids), x[torch.tensor(ids) % 64])
    tier.check_integrity()
    tier.close()


WRITER = textwrap.dedent("""
    import sys, torch
    from tiers.layout import BlockLayout
    from tiers.quant import quantize
    from tiers.redis import RedisTier
    url, namespace = sys.argv[1:3]
    g = torch.Generator().manual_seed(6)
    x = (torch.randn((8, 2, 2, 32, 64), generator=g) * 4).half()
    tier = RedisTier(BlockLayout(2, 32, 64), url, 1 << 26, namespace=namespace, shared=True, compression="zstd")
    tier.put(list(range(100, 108)), x)
    tier.put([200, 201], quantize(x[:2]))
    tier.close()  # a shared tier leaves its blocks
    print("ok")
""")


def test_another_process_reads_what_one_wrote(redis_url):
    namespace = f"fleet-{uuid.uuid4().hex[:8]}"
    out = subprocess.run([sys.executable, "-c", WRITER, redis_url, namespace],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    g = torch.Generator().manual_seed(6)
    x = (torch.randn((8, *LAYOUT.shape), generator=g) * 4).half()
    reader = RedisTier(LAYOUT, redis_url, 1 << 26, namespace=namespace, shared=True)
    with pytest.raises(BlockMissingError):
        reader.attach([100, 999])
    assert reader.num_blocks == 0  # all or none
    reader.attach(list(range(100, 108)) + [200, 201])
    assert torch.equal(reader.get(list(range(100, 108))), x)
    got, want = reader.get([200, 201]), quantize(x[:2])
    assert all(torch.equal(a, b) for a, b in zip(got.tensors(), want.tensors()))
    reader.check_integrity()
    raw = raw_client(redis_url)
    keys_before = len(list(raw.scan_iter(match=f"{namespace}:*")))
    # Ids in a shared namespace name content: putting the same blocks again stores nothing new.
    again = RedisTier(LAYOUT, redis_url, 1 << 26, namespace=namespace, shared=True)
    again.put(list(range(100, 108)), x)
    assert len(list(raw.scan_iter(match=f"{namespace}:*"))) == keys_before == 10
    assert torch.equal(again.get([103]), x[3:4])
    for t in (reader, again):
        t.delete([100])  # a shared tier only forgets
        t.close()
    assert raw.exists(reader.key(100))
    for i in list(range(100, 108)) + [200, 201]:
        raw.delete(reader.key(i))
    raw.close()


def test_private_namespaces_do_not_mix_and_close_cleans_up(redis_single):
    a = RedisTier(LAYOUT, redis_single.url, 1 << 26)
    b = RedisTier(LAYOUT, redis_single.url, 1 << 26)
    xa, xb = kv_like(3, seed=7), kv_like(3, seed=8)
    a.put([0, 1, 2], xa)
    b.put([0, 1, 2], xb)
    assert torch.equal(a.get([0, 1, 2]), xa) and torch.equal(b.get([0, 1, 2]), xb)
    same = RedisTier(LAYOUT, redis_single.url, 1 << 26, namespace=a.namespace)
    with pytest.raises(ValueError, match="already exist"):
        same.put([5, 2], xa[:2])  # never overwrites another store's block
    assert same.num_blocks == 0 and 5 not in same
    with redis_single.client() as raw:
        assert not raw.exists(a.key(5))
        for t in (a, b, same):
            t.close()
        assert not list(raw.scan_iter(match=f"{a.namespace}:*")) and not list(raw.scan_iter(match=f"{b.namespace}:*"))


def test_cluster_spreads_blocks_over_every_master(redis_cluster):
    tier = RedisTier(LAYOUT, redis_cluster.url, 1 << 26)
    assert tier.cluster
    tier.put(list(range(48)), kv_like(48, seed=9))
    counts = []
    for node in redis_cluster.nodes:
        with node.client() as raw:
            counts.append(raw.dbsize())
    assert sum(counts) == 48 and min(counts) > 0, counts
    tier.close()


def test_bad_settings_are_refused(redis_single):
    with pytest.raises(ValueError, match="no Redis answers"):
        RedisTier(LAYOUT, "redis://127.0.0.1:1/0", 1 << 20)
    with pytest.raises(ValueError, match="namespace"):
        RedisTier(LAYOUT, redis_single.url, 1 << 20, namespace="{tag}")
    with pytest.raises(ValueError, match="shared"):
        RedisTier(LAYOUT, redis_single.url, 1 << 20, shared=True)
    with pytest.raises(ValueError, match="compression"):
        RedisTier(LAYOUT, redis_single.url, 1 << 20, compression="lz4")


def test_ids_outside_u64_are_refused(redis_single):
    tier = RedisTier(LAYOUT, redis_single.url, 1 << 26)
    with pytest.raises(ValueError, match="2\\*\\*64"):
        tier.put([-1], kv_like(1, seed=10))
    tier.put([(1 << 64) - 1], kv_like(1, seed=10))  # the largest id (e.g. a 64-bit content hash) fits
    assert torch.equal(tier.get([(1 << 64) - 1]), kv_like(1, seed=10))
    tier.close()


def test_a_dead_cluster_master_is_a_clean_connection_error(tmp_path):
    require_redis()
    cluster = RedisCluster(str(tmp_path / "cluster"))
    try:
        tier = RedisTier(LAYOUT, cluster.url, 1 << 26, timeout=5)
        x = kv_like(48, seed=11)
        tier.put(list(range(48)), x)
        cluster.nodes[1].kill()
        with pytest.raises(ConnectionError):
            tier.get(list(range(48)))
        with pytest.raises(ConnectionError):
            tier.put(list(range(100, 148)), x)
        assert tier.num_blocks == 48 and 100 not in tier and tier.integrity_errors == 0
        on_live_node = [i for i in range(48) if cluster.nodes[1].port not in _node_ports(tier, i)]
        assert torch.equal(tier.get(on_live_node), x[on_live_node])  # the other masters still serve
    finally:
        cluster.stop()


def _node_ports(tier: RedisTier, block_id: int) -> set[int]:
    return {tier.client.get_node_from_key(tier.key(block_id)).port}


def test_a_batch_mixing_fp16_and_int8_comes_back_fp16(redis_single):
    tier = RedisTier(LAYOUT, redis_single.url, 1 << 26)
    x = kv_like(4, seed=12)
    tier.put([1, 2], x[:2])
    tier.put([3, 4], quantize(x[2:]))
    mixed = tier.get([3, 1, 4, 2])
    assert torch.equal(mixed[[1, 3]], x[:2])
    assert torch.equal(mixed[[0, 2]], dequantize(quantize(x[2:])))
    only_int8 = tier.get([4, 3])  # stays int8: nothing to match
    assert all(torch.equal(a, b) for a, b in zip(only_int8.tensors(), quantize(x[[3, 2]]).tensors()))
    tier.close()
