"""uvicorn's h11 protocol with a deadline on each request head.

uvicorn times out a keep-alive connection only after a response; a connection that never
sends a complete request head (nothing at all, or `GET /` and then silence) is held for
ever and counts against --limit-concurrency, so a few hundred such sockets would lock
every client out. Here each head must be complete within `head_timeout_s` of its first
byte (or of the connection), else the connection is closed. Bodies are timed in guard.py.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class TimedHeadProtocol(H11Protocol):
    head_timeout_s = 30.0  # set per server by with_head_timeout()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.head_timer: asyncio.TimerHandle | None = None
        self._arm_if_waiting_for_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._arm_if_waiting_for_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm_if_waiting_for_head(self) -> None:
        if self.conn.their_state is not h11.IDLE or self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # a head arrived: its body is timed by guard.py, the wait for the next by keep-alive
        elif self.head_timer is None and (self.conn.trailing_data[0] or self.timeout_keep_alive_task is None):
            self.head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if getattr(self, "head_timer", None) is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def with_head_timeout(seconds: float) -> type[TimedHeadProtocol]:
    """The protocol class to pass as uvicorn.Config(http=...)."""
    return type("TimedHeadProtocol", (TimedHeadProtocol,), {"head_timeout_s": seconds})
