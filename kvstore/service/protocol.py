"""uvicorn's HTTP protocols (httptools, or h11) with a deadline on each request head and a cap
on open connections.

uvicorn times out a keep-alive connection only after a response; a connection that never
sends a complete request head (nothing at all, or `GET /` and then silence) would be held for
ever, holding a file descriptor. Here each head must be complete within `head_timeout_s` of its
first byte (or of the connection), else the connection is closed. Bodies are timed in guard.py.

A connection beyond `max_connections` open is closed as soon as it is accepted, before anything
is read: the cap keeps accept() clear of the open-file limit. It is meant to sit far above
max_requests (guard.py), which is what bounds the work: idle connections take no request slot.

httptools (C, llhttp) is the default when installed: it parses and hands over body bytes
without h11's per-event Python work (bench_longctx/prefix_bench.py compares the two).
"""

from __future__ import annotations

import asyncio
from typing import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is a dependency; without it the service falls back to h11
    HttpToolsProtocol = None  # type: ignore[assignment,misc]


class HeadTimer:
    """One connection's deadline for a whole request head: closes the transport when it fires."""

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: asyncio.Transport, seconds: float,
                 still_waiting: Callable[[], bool]) -> None:
        self.loop, self.transport, self.seconds, self.still_waiting = loop, transport, seconds, still_waiting
        self.handle: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        if self.handle is None:
            self.handle = self.loop.call_later(self.seconds, self._fire)

    def disarm(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def _fire(self) -> None:
        self.handle = None
        if self.still_waiting() and not self.transport.is_closing():
            self.transport.close()


def over_cap(transport: asyncio.Transport, num_open: int, max_connections: int) -> bool:
    """Close a connection that takes the count of open ones past max_connections; whether it did."""
    if num_open <= max_connections:
        return False
    transport.close()
    return True


class TimedHeadProtocol(H11Protocol):
    head_timeout_s = 30.0  # set per server by with_limits()
    max_connections = 4096

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.head_timer = HeadTimer(self.loop, transport, self.head_timeout_s,
                                    lambda: self.conn.their_state is h11.IDLE)
        if not over_cap(transport, len(self.connections), self.max_connections):
            self._arm_if_waiting_for_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._arm_if_waiting_for_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self.head_timer.disarm()
        super().connection_lost(exc)

    def _arm_if_waiting_for_head(self) -> None:
        if self.conn.their_state is not h11.IDLE or self.cycle is not None and not self.cycle.response_complete:
            self.head_timer.disarm()  # a head arrived: its body is timed by guard.py, the wait for the next by keep-alive
        elif self.conn.trailing_data[0] or self.timeout_keep_alive_task is None:
            self.head_timer.arm()


if HttpToolsProtocol is not None:
    class TimedHeadHttpTools(HttpToolsProtocol):
        """The same deadline on httptools: armed at the connection and at each request's first byte
        (llhttp's on_message_begin), disarmed when the head is complete."""

        head_timeout_s = 30.0
        max_connections = 4096
        waiting_for_head = True

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.head_timer = HeadTimer(self.loop, transport, self.head_timeout_s, lambda: self.waiting_for_head)
            if not over_cap(transport, len(self.connections), self.max_connections):
                self.head_timer.arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.waiting_for_head = True
            self.head_timer.arm()

        def on_headers_complete(self) -> None:
            self.waiting_for_head = False
            self.head_timer.disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self.head_timer.disarm()
            super().connection_lost(exc)


def http_protocols() -> list[str]:
    """The protocols this install can serve with, the default first."""
    return (["httptools"] if HttpToolsProtocol is not None else []) + ["h11"]


def with_limits(head_timeout_s: float, max_connections: int, http: str = "h11") -> type:
    """The protocol class to pass as uvicorn.Config(http=...)."""
    if http not in http_protocols():
        raise ValueError(f"http must be one of {http_protocols()}, got {http!r}")
    base = TimedHeadHttpTools if http == "httptools" else TimedHeadProtocol
    return type(base.__name__, (base,), {"head_timeout_s": head_timeout_s, "max_connections": max_connections})
