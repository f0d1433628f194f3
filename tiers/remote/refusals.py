"""What a refused sidecar call raises: one ServiceError subclass per kind of refusal, each also the
built-in exception a caller would catch for it (ValueError, PermissionError, KeyError, ...), carrying
the server's status, error code and message (kvstore/service/app.py writes them)."""

from __future__ import annotations

import json

from tiers.base import IntegrityError


class ServiceError(RuntimeError):
    """The sidecar refused a request (status 0: it could not be reached)."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(status, code, detail)
        self.status, self.code, self.detail = status, code, detail

    def __str__(self) -> str:
        return f"kvtier service {self.status} {self.code}: {self.detail}"


class BadRequestError(ServiceError, ValueError):
    """400 or 413: the request was malformed or too large; nothing was stored."""


class AuthError(ServiceError, PermissionError):
    """401: missing or wrong token."""


class NotFoundError(ServiceError, KeyError):
    """404: the named keys are not stored."""


class StorageFullError(ServiceError, MemoryError):
    """507: the service's ssd budget is full; nothing was stored."""


class CorruptValueError(ServiceError, IntegrityError):
    """A stored value, or the bytes that came back, failed a checksum."""


class UnreachableError(ServiceError, ConnectionError):
    """The service could not be reached."""


_ERRORS = {400: BadRequestError, 401: AuthError, 404: NotFoundError, 413: BadRequestError, 507: StorageFullError}


def error_of(status: int, body: bytes) -> ServiceError:
    """The exception for an error response (a JSON {"error", "detail"} body, or any other bytes)."""
    try:
        content = json.loads(body)
        code, detail = str(content["error"]), str(content["detail"])
    except (ValueError, KeyError, TypeError):
        code, detail = "error", body[:500].decode(errors="replace")
    if code == "integrity_error":
        return CorruptValueError(status, code, detail)
    return _ERRORS.get(status, ServiceError)(status, code, detail)
