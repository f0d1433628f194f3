"""The engine-facing /v1/prefix routes: prompt chunks addressed by the hash chain of their token ids.

    POST /v1/prefix/{namespace}/lookup     how many leading tokens of a prompt are held
                                           (LMCache's lookup, vLLM's get_num_new_matched_tokens)
    POST /v1/prefix/{namespace}/retrieve   chunks by hash, one framed binary body (tiers/remote/wire.py)
    POST /v1/prefix/{namespace}/store      chunks by hash from one framed body; held ones are skipped

A chunk is whatever tensor an engine keeps for one block of block_tokens tokens (every layer's
K/V, typically); its hash is tiers/keys.py's chain hash, so it names the whole prefix up to it
and a lookup stops at the first chunk that is not held. Chunks are stored as values under the
key "chunk/<hash>" of their namespace, with the durability, checksums and limits of every value.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from kvstore.service.lookup import MAX_CHUNKS, ChunkHash, parse_lookup, read_lookup
from kvstore.service.routes import BINARY, BINARY_BODY, ERRORS, ChunksResponse, Namespace, blocking, read_body
from kvstore.service.settings import TooLarge
from tiers.remote.wire import check_chunk_hash, check_namespace, chunk_key, pack_batch, unpack_batch

router = APIRouter(prefix="/v1/prefix", tags=["prefix"])  # the token is checked before routing (guard.py)


class LookupResult(BaseModel):
    num_tokens: int = Field(description="leading tokens held: num_chunks x block_tokens")
    num_chunks: int
    chunk_hashes: list[str] = Field(description="hashes of the held leading chunks, in order: what to retrieve")


class HashesRequest(BaseModel):
    chunk_hashes: list[ChunkHash] = Field(max_length=MAX_CHUNKS)


class StoredChunks(BaseModel):
    namespace: str
    stored: int = Field(description="chunks stored by this request")
    held: int = Field(description="chunks skipped because they were held already (stored once)")
    nbytes: int = Field(description="payload bytes stored")


LOOKUP_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"$ref": "#/components/schemas/LookupRequest"}}}}}


@router.post("/{namespace}/lookup", response_model=LookupResult, responses=ERRORS, openapi_extra=LOOKUP_BODY)
async def lookup(namespace: Namespace, request: Request) -> Response:
    """How many leading tokens of a prompt are held: its full chunks are hashed in a chain and
    looked up in order; the first chunk not held ends the match. The body is bounded as it arrives,
    then parsed and hashed on a worker thread a slice at a time (kvstore/service/lookup.py)."""
    check_namespace(namespace)
    settings, storage, metrics = request.app.state.settings, request.app.state.storage, request.app.state.metrics
    pieces = await read_lookup(request, settings.max_lookup_tokens)

    def work() -> bytes:
        body = parse_lookup(pieces, settings.max_lookup_tokens)
        hashes = body.hashes()
        held = storage.num_held(namespace, [chunk_key(h) for h in hashes])
        metrics.lookup_requests.inc()
        metrics.lookup_tokens.inc(len(hashes) * body.block_tokens)
        metrics.lookup_hit_tokens.inc(held * body.block_tokens)
        return LookupResult(num_tokens=held * body.block_tokens, num_chunks=held,
                            chunk_hashes=hashes[:held]).model_dump_json().encode()

    return Response(await blocking(request, work), media_type="application/json")


@router.post("/{namespace}/retrieve", response_class=Response, responses={200: BINARY, **ERRORS})
async def retrieve(namespace: Namespace, body: HashesRequest, request: Request) -> Response:
    """Chunks by hash in one framed body (tiers/remote/wire.py; each item's key is its hash);
    404 names every chunk not held, and nothing is sent."""
    start = time.perf_counter()
    check_namespace(namespace)
    storage, metrics = request.app.state.storage, request.app.state.metrics
    limit = request.app.state.settings.max_body_bytes

    def work() -> list:
        for h in body.chunk_hashes:
            check_chunk_hash(h)
        values = storage.get(namespace, [chunk_key(h) for h in body.chunk_hashes])
        total = sum(len(v.payload) for v in values)
        if total > limit:
            raise TooLarge(f"retrieve of {total} bytes exceeds the limit of {limit} bytes; ask for fewer chunks")
        metrics.bytes_out.inc(total)
        return pack_batch([(h, v.desc, v.checksum) for h, v in zip(body.chunk_hashes, values)],
                          [v.payload for v in values])

    chunks = await blocking(request, work)
    metrics.retrieve_blocks.inc(len(body.chunk_hashes))
    return ChunksResponse(chunks, on_sent=lambda: metrics.retrieve_seconds.observe(time.perf_counter() - start))


@router.post("/{namespace}/store", status_code=201, response_model=StoredChunks, responses=ERRORS,
             openapi_extra=BINARY_BODY)
async def store(namespace: Namespace, request: Request) -> StoredChunks:
    """Chunks from one framed body (each item's key is its hash), all or none; chunks already held
    are skipped, not rewritten: a chunk's hash names its content."""
    start = time.perf_counter()
    check_namespace(namespace)
    settings, storage, metrics = request.app.state.settings, request.app.state.storage, request.app.state.metrics
    pieces = await read_body(request, settings.max_body_bytes)

    def work() -> tuple[int, int, int]:
        view = memoryview(b"".join(pieces))
        items = unpack_batch(view)
        for h, _, _, _, nbytes in items:
            check_chunk_hash(h)
            if nbytes > settings.max_value_bytes:
                raise TooLarge(f"chunk {h} is {nbytes} bytes; the limit is {settings.max_value_bytes}")
        stored, nbytes = storage.put_new(namespace, [(chunk_key(h), d, view[o: o + n], c) for h, d, c, o, n in items])
        return len(items), stored, nbytes

    count, stored, nbytes = await blocking(request, work)
    metrics.bytes_in.inc(nbytes)
    metrics.store_blocks.labels("stored").inc(stored)
    metrics.store_blocks.labels("held").inc(count - stored)
    metrics.store_seconds.observe(time.perf_counter() - start)
    return StoredChunks(namespace=namespace, stored=stored, held=count - stored, nbytes=nbytes)
