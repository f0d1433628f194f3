"""Prometheus metrics of one sidecar: its own registry, so two apps in one process never clash.

    kvtier_tier_bytes{tier}, kvtier_tier_blocks{tier}   gauges, tier = cpu (cache) | ssd (LMDB)
    kvtier_lookups_total{result}                        cpu_hit | ssd_hit | miss, per key
    kvtier_bytes_in_total, kvtier_bytes_out_total       tensor payload bytes received / sent
    kvtier_request_seconds{method, route}               latency histogram, route = path template
    kvtier_responses_total{method, route, status}       status = the HTTP status sent, or "disconnect" when
                                                        the client left while its request was being read
                                                        (uvicorn drops sends to a client that has gone, so
                                                        one leaving mid-response keeps the status sent)
    kvtier_requests_in_flight                           /v1 requests being read or answered now
    kvtier_overloaded_requests_total                    /v1 requests answered 503 "overloaded" (max_requests in flight)
    kvtier_integrity_errors_total                       stored values that failed a checksum
    kvtier_degraded                                     1 while the store runs read-only on a damaged file
    kvtier_damage_problems, kvtier_damaged_values       what the startup check of the LMDB file found
  prefix routes (/v1/prefix/..., named like LMCache's so its dashboards fit):
    kvtier_lookup_requests_total                        prefix lookups answered
    kvtier_lookup_tokens_total                          tokens asked about (full blocks x block_tokens)
    kvtier_lookup_hit_tokens_total                      leading tokens found held
    kvtier_retrieve_seconds, kvtier_store_seconds       time of a batched fetch (first byte of the request to
                                                        last byte of the answer) and store (through commit)
    kvtier_retrieve_blocks_total                        chunks sent by fetches
    kvtier_store_blocks_total{result}                   chunks of stores: stored | held (already there, skipped)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.requests import ClientDisconnect

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServiceMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.tier_bytes = Gauge("kvtier_tier_bytes", "Bytes stored per tier", ["tier"], registry=r)
        self.tier_blocks = Gauge("kvtier_tier_blocks", "Values stored per tier", ["tier"], registry=r)
        self.lookups = Counter("kvtier_lookups", "Key lookups by where they were found", ["result"], registry=r)
        self.bytes_in = Counter("kvtier_bytes_in", "Tensor payload bytes received", registry=r)
        self.bytes_out = Counter("kvtier_bytes_out", "Tensor payload bytes sent", registry=r)
        self.latency = Histogram("kvtier_request_seconds", "Request latency", ["method", "route"],
                                 buckets=_BUCKETS, registry=r)
        self.responses = Counter("kvtier_responses", "Responses", ["method", "route", "status"], registry=r)
        self.requests_in_flight = Gauge("kvtier_requests_in_flight", "/v1 requests being read or answered",
                                        registry=r)
        self.overloaded_requests = Counter("kvtier_overloaded_requests", "/v1 requests refused with 503 because "
                                           "max_requests were in flight", registry=r)
        self.integrity_errors = Counter("kvtier_integrity_errors", "Stored values that failed a checksum",
                                        registry=r)
        self.degraded = Gauge("kvtier_degraded", "1 while serving read-only from a damaged LMDB file", registry=r)
        self.damage_problems = Gauge("kvtier_damage_problems", "Structural problems the startup check found",
                                     registry=r)
        self.damaged_values = Gauge("kvtier_damaged_values", "Values the startup check could not keep", registry=r)
        self.lookup_requests = Counter("kvtier_lookup_requests", "Prefix lookups", registry=r)
        self.lookup_tokens = Counter("kvtier_lookup_tokens", "Tokens asked about by prefix lookups", registry=r)
        self.lookup_hit_tokens = Counter("kvtier_lookup_hit_tokens", "Leading tokens prefix lookups found held",
                                         registry=r)
        self.retrieve_seconds = Histogram("kvtier_retrieve_seconds", "Batched fetch by chunk hash, request to last "
                                          "byte sent", buckets=_BUCKETS, registry=r)
        self.store_seconds = Histogram("kvtier_store_seconds", "Batched store by chunk hash, request to commit",
                                       buckets=_BUCKETS, registry=r)
        self.retrieve_blocks = Counter("kvtier_retrieve_blocks", "Chunks sent by fetches", registry=r)
        self.store_blocks = Counter("kvtier_store_blocks", "Chunks of stores by outcome", ["result"], registry=r)
        for result in ("stored", "held"):
            self.store_blocks.labels(result)
        for result in ("cpu_hit", "ssd_hit", "miss"):
            self.lookups.labels(result)

    def watch_tier(self, tier: str, num_bytes: Callable[[], float], num_blocks: Callable[[], float]) -> None:
        """Gauges read at scrape time."""
        self.tier_bytes.labels(tier).set_function(num_bytes)
        self.tier_blocks.labels(tier).set_function(num_blocks)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Pure ASGI middleware: latency and status per route template (not per raw path)."""

    def __init__(self, app: ASGIApp, metrics: ServiceMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status, disconnected, complete = time.perf_counter(), "500", False, False

        async def receive_watching() -> Message:
            nonlocal disconnected
            message = await receive()
            disconnected = disconnected or (message["type"] == "http.disconnect" and not complete)
            return message

        async def send_with_status(message: Message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = str(message["status"])
            complete = message["type"] == "http.response.body" and not message.get("more_body", False)
            await send(message)

        try:
            await self.app(scope, receive_watching, send_with_status)
        except ClientDisconnect:
            disconnected = True  # nobody is left to answer; not a server error
        except Exception:
            if not disconnected:
                raise
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            self.metrics.latency.labels(scope["method"], path).observe(time.perf_counter() - start)
            self.metrics.responses.labels(scope["method"], path, "disconnect" if disconnected else status).inc()
