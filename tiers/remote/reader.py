"""Binary responses read straight into a tensor over keep-alive http.client connections.

httpx reads a body through h11 in 64 KiB pieces and copies every byte three times on the
way (receive buffer, extraction, bytes()); on the 2-core CI box that cost 1.3 ms of client
CPU per MB, twice what the service spends serving it. http.client's `readinto` fills the
destination with recv_into, one kernel copy: 0.47 ms/MB, and batched gets ran 1.8x faster
(bench_longctx/service_bench.py). tiers.remote.client uses this for get/get_many only; every
other call goes through its httpx client. One connection per thread, reused across calls.
"""

from __future__ import annotations

import http.client
import threading
from urllib.parse import urlsplit

import torch

# A reused keep-alive connection the server has meanwhile closed fails with one of these;
# the request is then sent once more on a fresh connection (reads are idempotent).
_STALE = (http.client.RemoteDisconnected, http.client.BadStatusLine, ConnectionResetError, BrokenPipeError)


class BinaryReader:
    def __init__(self, base_url: str, headers: dict[str, str], timeout: float) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url must be http(s)://host[:port][/prefix], got {base_url!r}")
        self.connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self.host, self.port, self.prefix = parts.hostname, parts.port, parts.path.rstrip("/")
        self.headers, self.timeout = headers, timeout
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[http.client.HTTPConnection] = []

    def fetch(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
              into: torch.Tensor | None = None) -> tuple[int, http.client.HTTPMessage, torch.Tensor | bytes]:
        """(status, headers, body): a uint8 CPU tensor for 2xx (a view of `into` when it is large enough),
        the raw error body otherwise.

        Raises OSError or http.client.HTTPException when the service cannot be reached."""
        for attempt in (0, 1):
            connection, reused = self._connection()
            try:
                connection.request(method, self.prefix + path, body=body, headers={**self.headers, **(headers or {})})
                response = connection.getresponse()
                if response.status >= 300:
                    return response.status, response.headers, response.read()
                return response.status, response.headers, _read_into_tensor(response, into)
            except _STALE:
                connection.close()
                if not reused or attempt:
                    raise
            except BaseException:
                connection.close()  # a half-read response must not be reused
                raise
        raise AssertionError("unreachable")

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        connection = getattr(self._local, "connection", None)
        reused = connection is not None and connection.sock is not None
        if connection is None:
            connection = self.connection_class(self.host, self.port, timeout=self.timeout)
            self._local.connection = connection
            with self._lock:
                self._connections.append(connection)
        return connection, reused

    def close(self) -> None:
        with self._lock:
            for connection in self._connections:
                connection.close()
            self._connections.clear()


def _read_into_tensor(response: http.client.HTTPResponse, into: torch.Tensor | None = None) -> torch.Tensor:
    """The body, read into `into` (a contiguous uint8 CPU tensor, reused: no fresh pages to fault in)
    when it is large enough, else into a new tensor."""
    length = response.getheader("content-length")
    if length is None or not length.isdigit():
        raise http.client.HTTPException("binary response without a Content-Length")
    fits = into is not None and into.numel() >= int(length)
    buf = into[: int(length)] if fits else torch.empty(int(length), dtype=torch.uint8)  # [nbytes]
    view, filled = memoryview(buf.numpy()), 0
    while filled < len(buf):
        got = response.readinto(view[filled:])
        if not got:
            raise http.client.IncompleteRead(bytes(0), len(buf) - filled)
        filled += got
    if response.read():  # also marks an empty body consumed, so the connection is reused
        raise http.client.HTTPException(f"response is longer than its Content-Length {len(buf)}")
    return buf
