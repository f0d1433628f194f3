"""The sidecar's FastAPI app: lifespan, auth, error mapping, health and metrics.

Every error is JSON {"error": <code>, "detail": <message>}:
    400 bad_request       malformed descriptor, name, body framing or checksum
    401 unauthorized      missing or wrong bearer token (checked before any body byte is read)
    404 not_found         unknown keys (all of them are named) or route
    408 body_timeout      the request body stalled for body_timeout_s; the connection is closed
    413 too_large         body or value over the configured limits, or a lookup of too many tokens
    500 integrity_error   a stored value failed its checksum (its bytes are never sent)
    500 internal_error    a bug; the detail names the exception type, the log has the traceback
    503 degraded          a write to a store that runs read-only on a damaged file (see /healthz)
    503 overloaded        max_requests /v1 requests were in flight; Retry-After says when to try again
    507 storage_full      the ssd budget cannot take the put; nothing was stored
Routes of the API itself live in kvstore/service/routes.py (blocks by key) and prefix.py (chunks by
hash); the gate every request passes
first (token, requests in flight, body limits, body timeout) in kvstore/service/guard.py.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvstore.service.damage import Degraded
from kvstore.service.guard import RequestGuard
from kvstore.service.metrics import MetricsMiddleware, ServiceMetrics
from kvstore.service.openapi import openapi_for
from kvstore.service.prefix import router as prefix_router
from kvstore.service.routes import router
from kvstore.service.settings import ServiceSettings, TooLarge
from kvstore.service.storage import NotFound, ServiceStorage, StorageFull
from tiers.remote.wire import WireError
from tiers.base import IntegrityError


def create_app(settings: ServiceSettings) -> FastAPI:
    metrics = ServiceMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        storage = ServiceStorage(settings.data_dir, settings.cpu_bytes, settings.ssd_bytes, metrics,
                                 settings.compression, settings.sync)
        metrics.watch_tier("cpu", lambda: storage.cache.bytes, lambda: len(storage.cache.items))
        metrics.watch_tier("ssd", lambda: storage.ssd.used_bytes, lambda: storage.ssd.num_blocks)
        app.state.storage = storage
        app.state.limiter = anyio.CapacityLimiter(settings.worker_threads)
        try:
            yield
        finally:
            storage.close()

    app = FastAPI(title="kvtier sidecar", version="1", lifespan=lifespan,
                  description="Shared, durable KV-cache block store. See tiers/remote/wire.py for the "
                              "binary formats and kvstore/service/app.py for the error codes.")
    app.state.settings = settings
    app.state.metrics = metrics
    app.add_middleware(RequestGuard, settings=settings, metrics=metrics)  # inner: runs after metrics started the clock
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    _add_error_handlers(app)
    app.include_router(router)
    app.include_router(prefix_router)

    @app.get("/healthz", tags=["ops"])
    async def healthz(request: Request) -> dict:
        """"ok", or "degraded" with what is damaged and how to repair it (never needs the token)."""
        return request.app.state.storage.health()

    @app.get("/metrics", tags=["ops"], response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    app.openapi = lambda: openapi_for(app, settings)  # type: ignore[method-assign]
    return app


def _error(status: int, code: str, detail: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": code, "detail": detail}, status_code=status, headers=headers)


# The service's own exceptions and how each is answered; the message is the detail.
_ANSWERS: dict[type[Exception], tuple[int, str]] = {
    WireError: (400, "bad_request"), NotFound: (404, "not_found"), TooLarge: (413, "too_large"),
    IntegrityError: (500, "integrity_error"), Degraded: (503, "degraded"), StorageFull: (507, "storage_full"),
}
_CODES = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed", 408: "body_timeout",
          413: "too_large", 507: "storage_full"}


def _add_error_handlers(app: FastAPI) -> None:
    async def answer(request: Request, exc: Exception) -> JSONResponse:
        status, code = next(_ANSWERS[c] for c in type(exc).__mro__ if c in _ANSWERS)
        return _error(status, code, str(exc.args[0]) if exc.args else type(exc).__name__)  # KeyError's str() quotes

    for exc_class in _ANSWERS:
        app.add_exception_handler(exc_class, answer)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, _CODES.get(exc.status_code, "error"), str(exc.detail), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in exc.errors())
        return _error(400, "bad_request", problems[:2000])

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # Runs in Starlette's outermost middleware, which logs the traceback after this answer.
        return _error(500, "internal_error", f"{type(exc).__name__} (see the server log)")
