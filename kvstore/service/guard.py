"""The gate every request passes before routing: token first, then a slot, then a bounded, timed body.

FastAPI reads and parses a declared JSON body before it runs any dependency, so a token
check written as a dependency comes after the body is buffered. Here the token is checked
on the raw headers, and `receive` is wrapped so that no route can read more than
`max_body_bytes` (413) or wait longer than `body_timeout_s` for the next piece (408).
Both answers carry `Connection: close`: the rest of the body is never read.

At most `max_requests` /v1 requests are in flight (from their head to their last byte sent);
one more is answered 503 "overloaded" with Retry-After, and counted. The limit counts requests,
not connections, so idle keep-alive sockets take nothing from it; /healthz and /metrics are
never refused, so an overloaded sidecar can still be watched.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

import anyio
from fastapi import HTTPException
from fastapi.responses import JSONResponse

from kvstore.service.metrics import ServiceMetrics
from kvstore.service.settings import ServiceSettings

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

CLOSE = {"Connection": "close"}
UNAUTHORIZED = "missing or wrong bearer token (send 'Authorization: Bearer <token>')"


def is_api(path: str) -> bool:
    """Paths of the API: the ones that take a request slot."""
    return path == "/v1" or path.startswith("/v1/")


def is_guarded(path: str) -> bool:
    """Paths that need the token when one is configured: the API and the metrics."""
    return path == "/metrics" or is_api(path)


class RequestGuard:
    """Pure ASGI middleware: auth on headers, a request slot, then a receive that enforces the body limits."""

    def __init__(self, app: ASGIApp, settings: ServiceSettings, metrics: ServiceMetrics) -> None:
        self.app = app
        self.settings = settings
        self.metrics = metrics
        self.token = settings.token.encode() if settings.token is not None else None
        self.in_flight = 0
        metrics.requests_in_flight.set_function(lambda: self.in_flight)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers, slot = dict(scope["headers"]), is_api(scope["path"])
        if self.token is not None and is_guarded(scope["path"]) and not self._authorized(headers):
            await _reject(scope, receive, send, 401, "unauthorized", UNAUTHORIZED, {"WWW-Authenticate": "Bearer"})
            return
        if slot and self.in_flight >= self.settings.max_requests:
            self.metrics.overloaded_requests.inc()
            await _reject(scope, receive, send, 503, "overloaded", f"{self.in_flight} requests in flight, the "
                          f"limit (max_requests); retry after 1 s", {"Retry-After": "1"})
            return
        declared = headers.get(b"content-length", b"")
        limit = self.settings.max_body_bytes
        if declared.isdigit() and int(declared) > limit:
            await _reject(scope, receive, send, 413, "too_large",
                          f"body of {int(declared)} bytes exceeds the limit of {limit} bytes")
            return
        self.in_flight += slot
        try:
            await self.app(scope, self._bounded(receive), send)
        finally:
            self.in_flight -= slot

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, credentials = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), self.token)

    def _bounded(self, receive: Receive) -> Receive:
        limit, timeout = self.settings.max_body_bytes, self.settings.body_timeout_s
        received, done = 0, False

        async def bounded_receive() -> Message:
            nonlocal received, done
            if done:  # after the body only a disconnect can come: no timeout on waiting for it
                return await receive()
            with anyio.move_on_after(timeout) as waited:
                message = await receive()
            if waited.cancelled_caught:
                raise HTTPException(408, f"request body stalled: no bytes arrived for {timeout:g} s", headers=CLOSE)
            if message["type"] != "http.request":
                done = True
                return message
            received += len(message.get("body", b""))
            if received > limit:
                raise HTTPException(413, f"body exceeds the limit of {limit} bytes", headers=CLOSE)
            done = not message.get("more_body", False)
            return message

        return bounded_receive


async def _reject(scope: Scope, receive: Receive, send: Send, status: int, code: str, detail: str,
                  headers: dict[str, str] | None = None) -> None:
    response = JSONResponse({"error": code, "detail": detail}, status_code=status, headers={**(headers or {}), **CLOSE})
    await response(scope, receive, send)
