"""What every request is checked against: the service's settings, its limits and its token."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer


@dataclass(slots=True)
class ServiceSettings:
    data_dir: str
    cpu_bytes: int = 1 << 30
    ssd_bytes: int = 64 << 30
    token: str | None = None
    compression: str = "none"  # "none" or "zstd" (smaller on disk, slower puts and cold reads)
    sync: bool = True  # fsync every LMDB commit
    max_value_bytes: int = 256 << 20  # one tensor
    max_body_bytes: int = 1 << 30  # one request body (a batch)
    worker_threads: int = 16  # blocking LMDB / checksum / zstd work runs on these, never on the event loop

    def __post_init__(self) -> None:
        for name in ("cpu_bytes", "ssd_bytes", "max_value_bytes", "max_body_bytes", "worker_threads"):
            if getattr(self, name) < (0 if name == "cpu_bytes" else 1):
                raise ValueError(f"ServiceSettings.{name} must be positive, got {getattr(self, name)}")
        if self.token is not None and not self.token:
            raise ValueError("ServiceSettings.token must be a non-empty string or None")


class TooLarge(ValueError):
    """A body or value over the configured limits (413)."""


_bearer = HTTPBearer(auto_error=False, description="required when the server was started with --token")


async def require_token(request: Request, cred: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    token = request.app.state.settings.token
    if token is None:
        return
    if cred is None or not hmac.compare_digest(cred.credentials.encode(), token.encode()):
        raise HTTPException(401, "missing or wrong bearer token (send 'Authorization: Bearer <token>')",
                            headers={"WWW-Authenticate": "Bearer"})
