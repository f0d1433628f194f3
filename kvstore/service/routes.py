"""The /v1 API: tensors addressed by (namespace, key), binary bodies, explicit descriptors.

Formats are in tiers/remote/wire.py, errors in kvstore/service/app.py. Handlers only
parse and check on the event loop; LMDB, checksums, zstd and batch assembly run on
worker threads (`blocking`).
"""

from __future__ import annotations

from typing import Annotated, Callable

import anyio
from fastapi import APIRouter, Header, Path, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field
from starlette.types import Receive, Scope, Send

from kvstore.service.settings import TooLarge
from kvstore.service.storage import ServiceStorage
from tiers.remote.wire import (
    DTYPES, H_CHECKSUM, LAYOUT_VERSION, Descriptor, WireError, check_key, check_namespace, check_prefix, format_checksum,
    pack_batch, parse_checksum, unpack_batch,
)

router = APIRouter(prefix="/v1", tags=["blocks"])  # the token is checked before routing (guard.py)


class ErrorBody(BaseModel):
    error: str
    detail: str


class Stored(BaseModel):
    namespace: str
    stored: int = Field(description="values stored")
    nbytes: int = Field(description="payload bytes stored")


_KEY_PATTERN = "^[A-Za-z0-9_~:@+=-]+(/[A-Za-z0-9_~:@+=-]+)*$"


class KeysRequest(BaseModel):
    keys: list[Annotated[str, Field(json_schema_extra={"pattern": _KEY_PATTERN, "maxLength": 400})]] = \
        Field(max_length=100_000)


class KeysPage(BaseModel):
    keys: list[str]
    truncated: bool = Field(description="more keys follow; ask again with after=<last key>")


class Deleted(BaseModel):
    deleted: int


class NamespaceStats(BaseModel):
    namespace: str
    blocks: int
    bytes: int


BINARY = {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}
BINARY_BODY = {"requestBody": {"required": True, **BINARY}}
# 401, 408 and 413 from the guard are added by openapi.py (401 only when a token is configured).
ERRORS: dict = {code: {"model": ErrorBody} for code in (400, 404, 500, 503, 507)}
# Patterns and enums below only document the API (and steer schemathesis); the wire.check_* functions
# enforce them with messages that name the problem.
Namespace = Annotated[str, Path(description="namespaces never share keys; '.' and '..' are not names",
                                json_schema_extra={"pattern": r"^(?!\.\.?$)[A-Za-z0-9_.-]{1,64}$"})]
Key = Annotated[str, Path(description="'/'-separated segments of [A-Za-z0-9_.~:@+=-] (a segment may not be "
                                      "'.' or '..'), at most 400 bytes",
                          json_schema_extra={"pattern": _KEY_PATTERN})]
Dtype = Annotated[str, Header(json_schema_extra={"enum": list(DTYPES)})]
Shape = Annotated[str, Header(description="comma separated dims; empty for a 0-d tensor",
                              json_schema_extra={"pattern": "^([0-9]{1,4}(,[0-9]{1,4}){0,3})?$"})]
Layout = Annotated[str, Header(json_schema_extra={"enum": [str(LAYOUT_VERSION)]})]
_PREFIX_SCHEMA = {"pattern": "^[A-Za-z0-9_.~:@+=/-]*$", "maxLength": 400}
Prefix = Annotated[str, Query(description="only keys that start with this", json_schema_extra=_PREFIX_SCHEMA)]
After = Annotated[str, Query(description="only keys that sort after this one (the last key of the previous page)",
                             json_schema_extra=_PREFIX_SCHEMA)]


async def blocking(request: Request, fn: Callable, *args: object):
    return await anyio.to_thread.run_sync(fn, *args, limiter=request.app.state.limiter)


async def read_body(request: Request, limit: int, expected: int | None = None) -> list[bytes]:
    """The body's chunks (joined later, off the event loop); TooLarge past `limit`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit():
        if int(declared) > limit:
            raise TooLarge(f"body of {declared} bytes exceeds the limit of {limit} bytes")
        if expected is not None and int(declared) != expected:
            raise WireError(f"body has {declared} bytes; the descriptor needs {expected}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return chunks


class ChunksResponse(Response):
    """A binary body sent in pieces of at most 256 KiB, one ASGI message each: no join of the
    whole body, and each piece mostly fits the socket buffer, so asyncio sends it directly
    instead of copying it into its transport buffer first (-25% server CPU per byte)."""

    PIECE = 256 << 10

    def __init__(self, chunks: list, headers: dict[str, str] | None = None,
                 on_sent: Callable[[], None] | None = None) -> None:
        views = (memoryview(c) for c in chunks)
        self.pieces = [v[i: i + self.PIECE] for v in views for i in range(0, len(v), self.PIECE)] or [b""]
        self.on_sent = on_sent  # called once the last piece was handed to the server
        total = str(sum(map(len, self.pieces)))
        super().__init__(None, media_type="application/octet-stream", headers={**(headers or {}), "content-length": total})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for i, piece in enumerate(self.pieces):
            await send({"type": "http.response.body", "body": piece, "more_body": i + 1 < len(self.pieces)})
        if self.on_sent is not None:
            self.on_sent()


def _storage(request: Request) -> ServiceStorage:
    return request.app.state.storage


@router.put("/namespaces/{namespace}/blocks/{key:path}", status_code=201, response_model=Stored,
            responses=ERRORS, openapi_extra=BINARY_BODY)
async def put_block(
    namespace: Namespace, key: Key, request: Request,
    x_kvtier_dtype: Dtype, x_kvtier_shape: Shape, x_kvtier_layout: Layout,
    x_kvtier_checksum: Annotated[str | None, Header(description="xxh3-64 of the body, 16 hex digits")] = None,
) -> Stored:
    """Store one tensor (raw bytes) under (namespace, key), replacing any earlier value."""
    check_namespace(namespace)
    check_key(key)
    desc = Descriptor.from_headers(x_kvtier_dtype, x_kvtier_shape, x_kvtier_layout)
    checksum = parse_checksum(x_kvtier_checksum)
    settings = request.app.state.settings
    if desc.nbytes > settings.max_value_bytes:
        raise TooLarge(f"{desc.dtype} {list(desc.shape)} is {desc.nbytes} bytes; the limit is {settings.max_value_bytes}")
    chunks = await read_body(request, min(settings.max_value_bytes, settings.max_body_bytes), desc.nbytes)
    size = sum(map(len, chunks))
    if size != desc.nbytes:
        raise WireError(f"body has {size} bytes; {desc.dtype} {list(desc.shape)} needs {desc.nbytes}")

    def work() -> int:
        return _storage(request).put(namespace, [(key, desc, b"".join(chunks), checksum)])

    nbytes = await blocking(request, work)
    request.app.state.metrics.bytes_in.inc(nbytes)
    return Stored(namespace=namespace, stored=1, nbytes=nbytes)


@router.get("/namespaces/{namespace}/blocks/{key:path}", response_class=Response,
            responses={200: BINARY, **ERRORS})
async def get_block(namespace: Namespace, key: Key, request: Request) -> Response:
    """One tensor's raw bytes; the descriptor and checksum come back in x-kvtier-* headers."""
    check_namespace(namespace)
    check_key(key)
    (value,) = await blocking(request, _storage(request).get, namespace, [key])
    request.app.state.metrics.bytes_out.inc(len(value.payload))
    headers = {**value.desc.headers(), H_CHECKSUM: format_checksum(value.checksum)}
    return ChunksResponse([value.payload], headers)


@router.delete("/namespaces/{namespace}/blocks/{key:path}", response_model=Deleted, responses=ERRORS)
async def delete_block(namespace: Namespace, key: Key, request: Request) -> Deleted:
    check_namespace(namespace)
    check_key(key)
    return Deleted(deleted=await blocking(request, _storage(request).delete, namespace, [key]))


@router.post("/namespaces/{namespace}/batch/get", response_class=Response, responses={200: BINARY, **ERRORS})
async def batch_get(namespace: Namespace, body: KeysRequest, request: Request) -> Response:
    """Many tensors in one framed body (tiers/remote/wire.py); 404 names every missing key."""
    check_namespace(namespace)
    limit = request.app.state.settings.max_body_bytes

    def work() -> list:
        for key in body.keys:
            check_key(key)
        values = _storage(request).get(namespace, body.keys)
        total = sum(len(v.payload) for v in values)
        if total > limit:
            raise TooLarge(f"batch of {total} bytes exceeds the limit of {limit} bytes; ask for fewer keys")
        request.app.state.metrics.bytes_out.inc(total)
        return pack_batch([(k, v.desc, v.checksum) for k, v in zip(body.keys, values)], [v.payload for v in values])

    return ChunksResponse(await blocking(request, work))


@router.post("/namespaces/{namespace}/batch/put", status_code=201, response_model=Stored, responses=ERRORS,
             openapi_extra=BINARY_BODY)
async def batch_put(namespace: Namespace, request: Request) -> Stored:
    """Store many tensors from one framed body (tiers/remote/wire.py), all or none."""
    check_namespace(namespace)
    settings = request.app.state.settings
    chunks = await read_body(request, settings.max_body_bytes)

    def work() -> tuple[int, int]:
        view = memoryview(b"".join(chunks))
        items = unpack_batch(view)
        for key, _, _, _, nbytes in items:
            if nbytes > settings.max_value_bytes:
                raise TooLarge(f"batch item {key!r} is {nbytes} bytes; the limit is {settings.max_value_bytes}")
        stored = _storage(request).put(namespace, [(k, d, view[o: o + n], c) for k, d, c, o, n in items])
        return len(items), stored

    count, nbytes = await blocking(request, work)
    request.app.state.metrics.bytes_in.inc(nbytes)
    return Stored(namespace=namespace, stored=count, nbytes=nbytes)


@router.post("/namespaces/{namespace}/batch/delete", response_model=Deleted, responses=ERRORS)
async def batch_delete(namespace: Namespace, body: KeysRequest, request: Request) -> Deleted:
    """Delete every key, or none (404 naming the missing ones)."""
    check_namespace(namespace)

    def work() -> int:
        for key in body.keys:
            check_key(key)
        return _storage(request).delete(namespace, body.keys)

    return Deleted(deleted=await blocking(request, work))


@router.get("/namespaces/{namespace}/keys", response_model=KeysPage, responses=ERRORS)
async def list_keys(
    namespace: Namespace, request: Request, prefix: Prefix = "", after: After = "",
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> KeysPage:
    """Keys starting with `prefix`, in byte order; page with `after` = the last key seen."""
    check_namespace(namespace)
    check_prefix(prefix)
    check_prefix(after)
    keys, truncated = await blocking(request, _storage(request).keys, namespace, prefix, after, limit)
    return KeysPage(keys=keys, truncated=truncated)


@router.get("/namespaces/{namespace}/stats", response_model=NamespaceStats, responses=ERRORS)
async def namespace_stats(namespace: Namespace, request: Request) -> NamespaceStats:
    check_namespace(namespace)
    return NamespaceStats(**_storage(request).namespace_stats(namespace))


@router.delete("/namespaces/{namespace}", response_model=Deleted, responses=ERRORS)
async def drop_namespace(namespace: Namespace, request: Request) -> Deleted:
    """Delete every key of a namespace."""
    check_namespace(namespace)
    return Deleted(deleted=await blocking(request, _storage(request).drop, namespace))


@router.get("/namespaces", responses=ERRORS)
async def namespaces(request: Request) -> dict[str, NamespaceStats]:
    """Every namespace that holds values, with its totals."""
    return {ns: NamespaceStats(**_storage(request).namespace_stats(ns)) for ns in _storage(request).namespace_names()}


@router.get("/stats", responses=ERRORS)
async def stats(request: Request) -> dict:
    """Tiers (cpu cache, ssd), namespace count, integrity errors, durability mode."""
    return _storage(request).stats()
