"""Fixtures of the tier tests (real Redis servers: tests/tiers/redis_servers.py)."""

from tests.tiers.redis_servers import redis_cluster, redis_server, redis_single, redis_url  # noqa: F401
