"""What every request is checked against: the service's settings, its limits and its token."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# RFC 6750 b64token: what an Authorization header can carry unchanged (no spaces, no quotes).
_TOKEN = re.compile(r"[A-Za-z0-9._~+/-]+=*")


@dataclass(slots=True)
class ServiceSettings:
    data_dir: str
    cpu_bytes: int = 1 << 30
    ssd_bytes: int = 64 << 30
    token: str | None = None
    compression: str = "none"  # "none" or "zstd" (smaller on disk, slower puts and cold reads)
    sync: bool = True  # fsync every LMDB commit
    max_value_bytes: int = 256 << 20  # one tensor
    max_body_bytes: int = 1 << 30  # one request body (a batch or a JSON key list)
    body_timeout_s: float = 30.0  # longest wait for the next piece of a request body (then 408, connection closed)
    worker_threads: int = 16  # blocking LMDB / checksum / zstd work runs on these, never on the event loop
    # /v1 requests being read or answered at once; more get 503 "overloaded". Open connections do not count:
    # an idle one costs a socket, and there may be max_connections of them (beyond, new ones are closed).
    max_requests: int = 1024
    max_connections: int = 4096
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    # Token ids (or chunk hashes) one prefix lookup may name: bounds its memory and parsing time (lookup.py).
    max_lookup_tokens: int = 1 << 22

    def __post_init__(self) -> None:
        for name in ("cpu_bytes", "ssd_bytes", "max_value_bytes", "max_body_bytes", "worker_threads", "max_requests",
                     "max_connections", "max_lookup_tokens"):
            if getattr(self, name) < (0 if name == "cpu_bytes" else 1):
                raise ValueError(f"ServiceSettings.{name} must be positive, got {getattr(self, name)}")
        for name in ("body_timeout_s", "keep_alive_s"):
            seconds = getattr(self, name)
            if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"ServiceSettings.{name} must be a positive number of seconds, got {seconds!r}")
        check_token(self.token)


def check_token(token: str | None) -> None:
    """None (no auth) or a usable bearer token; an empty or whitespace token is a mistake, never 'no auth'."""
    if token is None:
        return
    if not isinstance(token, str) or not token.strip():
        raise ValueError("token must not be empty or whitespace; pass a real secret, or none to disable auth "
                         "(only allowed on a loopback bind)")
    if not _TOKEN.fullmatch(token):
        raise ValueError("token must be letters, digits and ._~+/- (RFC 6750 b64token, no spaces or quotes) "
                         f"so an 'Authorization: Bearer' header can carry it; got {len(token)} characters that are not")


class TooLarge(ValueError):
    """A body or value over the configured limits (413)."""
