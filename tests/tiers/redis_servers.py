"""Fixtures that start and stop real redis-server processes (bench_longctx.redis_servers).

The module-wide servers are shared by tests that only add and remove their own keys; a test
that kills, restarts or reconfigures a server starts its own with `redis_server(...)`.
Without redis-server installed the tests skip and say so (CI installs it: .ci/run).
"""

from __future__ import annotations

import pytest
import redis

from bench_longctx.redis_servers import RedisCluster, RedisServer, missing_binaries


def raw_client(url: str) -> redis.Redis | redis.RedisCluster:
    """A plain redis-py client for `url` (a cluster client if the node is in a cluster): what tests
    use to look at, damage or remove values behind the tier."""
    client = redis.Redis.from_url(url)
    if client.info("cluster").get("cluster_enabled") == 1:
        client.close()
        return redis.RedisCluster.from_url(url)
    return client


def require_redis() -> None:
    reason = missing_binaries()
    if reason:
        pytest.skip(f"redis tier tests need a real server: {reason}")


@pytest.fixture(scope="session")
def redis_single(tmp_path_factory):
    require_redis()
    server = RedisServer(str(tmp_path_factory.mktemp("redis-single")))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    require_redis()
    cluster = RedisCluster(str(tmp_path_factory.mktemp("redis-cluster")))
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_server(tmp_path):
    """redis_server(*config) -> a fresh RedisServer of this test, stopped after it."""
    require_redis()
    started: list[RedisServer] = []

    def start(*config: str) -> RedisServer:
        started.append(RedisServer(str(tmp_path / f"redis{len(started)}"), *config))
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture(params=["single", "cluster"])
def redis_url(request) -> str:
    """Each test runs against one instance and against a 3-master cluster."""
    return request.getfixturevalue(f"redis_{request.param}").url
