"""Keys a private redis tier wrote but never recorded (a put whose replies were lost: a client
timeout, or a server killed mid-pipeline and restarted) are its own: a later put of those ids
overwrites them, reads return what that put stored, and close() removes them."""

from __future__ import annotations

import threading
import time

import pytest
import redis
import torch

from tests.tiers.redis_servers import raw_client
from tests.tiers.test_redis import LAYOUT, kv_like
from tiers.redis import RedisTier


def _sleep_server(url: str, seconds: float) -> threading.Thread:
    """Blocks the server's event loop for `seconds` (DEBUG SLEEP); returns once it is asleep."""
    sleeper = threading.Thread(target=lambda: raw_client(url).execute_command("DEBUG", "SLEEP", seconds))
    sleeper.start()
    probe = redis.Redis.from_url(url, socket_timeout=0.1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            probe.ping()
        except redis.exceptions.TimeoutError:
            probe.close()
            return sleeper
        time.sleep(0.01)
    raise AssertionError("the server never fell asleep")


def _namespace_keys(url: str, tier: RedisTier) -> list[bytes]:
    with raw_client(url) as raw:
        return sorted(raw.scan_iter(match=f"{tier.namespace}:*"))


def test_sets_applied_after_a_client_timeout_do_not_wedge_later_puts(redis_server):
    server = redis_server("--enable-debug-command", "yes")
    tier = RedisTier(LAYOUT, server.url, 1 << 26, timeout=0.5)
    stale, fresh = kv_like(4, seed=20), kv_like(4, seed=21)
    tier.put([0, 1], fresh[:2])
    sleeper = _sleep_server(server.url, 2)
    with pytest.raises(ConnectionError):
        tier.put([2, 3], stale[2:])  # sent, then the client gives up waiting for the replies
    sleeper.join()
    with raw_client(server.url) as raw:
        assert raw.exists(tier.key(2), tier.key(3)) == 2  # Redis applied the SETs once it woke
    assert 2 not in tier and tier.num_blocks == 2
    tier.check_integrity()
    tier.put([2, 3], fresh[2:])
    assert torch.equal(tier.get([3, 0, 2, 1]), fresh[[3, 0, 2, 1]])
    tier.check_integrity()
    tier.close()
    assert _namespace_keys(server.url, tier) == []


def test_a_server_killed_mid_put_and_restarted_does_not_wedge_later_puts(redis_server):
    server = redis_server("--appendonly", "yes", "--appendfsync", "always")
    tier = RedisTier(LAYOUT, server.url, 1 << 26, timeout=5)
    x = kv_like(8, seed=22)
    tier.put([0, 1, 2, 3], x[:4])
    server.kill()
    with pytest.raises(ConnectionError):
        tier.put([4, 5, 6, 7], x[4:])
    server.start()  # same directory: the AOF is replayed
    with raw_client(server.url) as raw:  # what the lost writes left: here block 0's value under 4 and 5
        block_0 = raw.get(tier.key(0))
        raw.set(tier.key(4), block_0)
        raw.set(tier.key(5), block_0)
    with pytest.raises(KeyError):
        tier.get([4])  # never recorded: not served
    tier.check_integrity()
    tier.put([4, 5, 6, 7], x[4:])
    assert torch.equal(tier.get(list(range(8))), x)
    tier.check_integrity()
    tier.close()
    assert _namespace_keys(server.url, tier) == []
