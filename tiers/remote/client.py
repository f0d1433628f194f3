"""Python client of the kvtier sidecar (`kvtier serve`): tensors by (namespace, key) over HTTP.

    with Client("http://127.0.0.1:8470", token=None) as c:
        c.put("engine-a", "seq7/layer3/block0", blocks)        # any CPU/GPU tensor, 6 dtypes
        t = c.get("engine-a", "seq7/layer3/block0")            # CPU tensor, bit-exact
        ts = c.get_many("engine-a", ["k1", "k2"])              # one request

    Prompt chunks by the hash chain of their token ids (tiers/keys.py), for engines:
        keys = ChunkKeys("llama-3-8b", 32, 32, 8, 128, block_tokens=256)
        c.store_chunks("engine-a", zip(keys.hashes(prompt), chunk_tensors))  # held ones skipped
        held = c.lookup_prefix("engine-a", prompt, keys)       # held.num_tokens leading tokens
        chunks = c.retrieve_chunks("engine-a", held.chunk_hashes)

Connections are kept alive and reused, and a Client is safe to share between threads:
httpx for every call but get/get_many, whose bodies tiers.remote.reader reads straight
into the result tensor (see there why). A GET, PUT or DELETE whose connection dropped before
a whole answer came is sent once more, as reads are (a server closing a kept-alive connection
races the next request); a POST or an error answer never is. Every value carries an xxh3-64
checksum both ways: the service rejects a put whose bytes changed on the way, the client
rejects a get whose bytes did. Errors raise a ServiceError subclass (tiers/remote/refusals.py).
"""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence
from urllib.parse import quote

import httpx
import torch
import xxhash

from tiers.keys import ChunkKeys
from tiers.remote.refusals import (  # noqa: F401  (callers import the errors from here too)
    AuthError, BadRequestError, CorruptValueError, NotFoundError, ServiceError, StorageFullError, UnreachableError,
    error_of,
)
from tiers.remote.reader import BinaryReader
from tiers.remote.wire import (
    DTYPES, H_CHECKSUM, H_DTYPE, H_LAYOUT, H_SHAPE, Descriptor, check_chunk_hash, check_key, check_namespace, chunk_key,
    format_checksum, pack_batch, parse_checksum, unpack_batch,
)

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32,
}
_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}
assert set(TORCH_DTYPES) == set(DTYPES)

# The connection dropped before a whole answer came: a kept-alive connection the server closed as the
# request went out, most often. A request whose repeat changes nothing more (RFC 9110's idempotent
# methods: a PUT replaces the value under its key) is then sent once more; a POST, a timeout (the
# service may still be at work) and an error answer never are.
_UNANSWERED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
_IDEMPOTENT = frozenset({"GET", "PUT", "DELETE"})


@dataclass(frozen=True, slots=True)
class HeldPrefix:
    """The leading chunks of a prompt that the sidecar holds."""

    num_tokens: int  # num_chunks x block_tokens
    num_chunks: int
    chunk_hashes: tuple[str, ...]  # the held chunks' hashes, in order: what retrieve_chunks takes


class Client:
    def __init__(self, base_url: str, token: str | None = None, timeout: float = 120.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout,
                                 transport=httpx.HTTPTransport(retries=2))
        self.reader = BinaryReader(self.base_url, headers, timeout)

    # -- values --------------------------------------------------------------------------------
    def put(self, namespace: str, key: str, tensor: torch.Tensor) -> None:
        """Store `tensor` (copied to CPU, C order) under (namespace, key), replacing any earlier value."""
        desc, view = tensor_bytes(tensor)
        headers = {**desc.headers(), H_CHECKSUM: format_checksum(xxhash.xxh3_64_intdigest(view)),
                   "Content-Type": "application/octet-stream", "Content-Length": str(len(view))}
        self._call("PUT", _block_url(namespace, key), content=[view], headers=headers)

    def put_many(self, namespace: str, items: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Store many tensors in one request, all or none."""
        pairs = list(items.items()) if isinstance(items, Mapping) else list(items)
        encoded = [tensor_bytes(t) for _, t in pairs]
        chunks = pack_batch([(k, d, xxhash.xxh3_64_intdigest(v)) for (k, _), (d, v) in zip(pairs, encoded)],
                            [v for _, v in encoded])
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(sum(map(len, chunks)))}
        self._call("POST", f"/v1/namespaces/{_q(namespace)}/batch/put", content=chunks, headers=headers)

    def get(self, namespace: str, key: str) -> torch.Tensor:
        """The tensor stored under (namespace, key), on CPU; NotFoundError if there is none."""
        buf, headers = self._download("GET", _block_url(namespace, key))
        fields = [headers.get(name) for name in (H_DTYPE, H_SHAPE, H_LAYOUT, H_CHECKSUM)]
        if None in fields:
            raise CorruptValueError(200, "bad_response", f"{namespace}/{key}: response lacks x-kvtier-* headers")
        desc = Descriptor.from_headers(*fields[:3])
        return value_tensor(buf, desc, parse_checksum(fields[3]), f"{namespace}/{key}")

    def get_many(self, namespace: str, keys: Sequence[str]) -> list[torch.Tensor]:
        """Tensors of `keys` in order, from one request (views into one buffer); NotFoundError names the missing."""
        if not keys:
            return []
        body = json.dumps({"keys": list(keys)}).encode()
        buf, _ = self._download("POST", f"/v1/namespaces/{_q(namespace)}/batch/get", body)
        items = unpack_batch(memoryview(buf.numpy()))
        if [k for k, *_ in items] != list(keys):
            raise CorruptValueError(200, "bad_response", "batch get answered other keys than were asked")
        return [value_tensor(buf[o: o + n], d, c, f"{namespace}/{k}") for k, d, c, o, n in items]

    def delete(self, namespace: str, key: str) -> None:
        """NotFoundError if nothing is stored there (also when an unanswered first try deleted it)."""
        self._call("DELETE", _block_url(namespace, key))

    def delete_many(self, namespace: str, keys: Sequence[str]) -> int:
        """Delete all `keys`, or none if any is missing (NotFoundError names them)."""
        return self._call("POST", f"/v1/namespaces/{_q(namespace)}/batch/delete", json={"keys": list(keys)}).json()["deleted"]

    def keys(self, namespace: str, prefix: str = "") -> list[str]:
        """Every key of `namespace` that starts with `prefix`, sorted (pages through the listing)."""
        out: list[str] = []
        while True:
            params = {"prefix": prefix, "after": out[-1] if out else "", "limit": 10_000}
            page = self._call("GET", f"/v1/namespaces/{_q(namespace)}/keys", params=params).json()
            out += page["keys"]
            if not page["truncated"]:
                return out

    def drop_namespace(self, namespace: str) -> int:
        """Delete every key of `namespace`; returns how many there were (0 if an unanswered first try dropped them)."""
        return self._call("DELETE", f"/v1/namespaces/{_q(namespace)}").json()["deleted"]

    # -- prompt chunks by hash -----------------------------------------------------------------
    def lookup_prefix(self, namespace: str, token_ids: Sequence[int], keys: ChunkKeys) -> HeldPrefix:
        """How many leading tokens of the prompt are held (vLLM's get_num_new_matched_tokens). The chain is
        hashed here (tiers/keys.py, the code the server hashes token_ids with): 16 bytes go per chunk, not
        8 per token, and the server parses 1/block_tokens as much JSON (4x faster lookups at 128K tokens)."""
        return self.lookup_chunks(namespace, keys.hashes(token_ids), keys.block_tokens)

    def lookup_chunks(self, namespace: str, chunk_hashes: Sequence[str | bytes], block_tokens: int) -> HeldPrefix:
        """The same, for a prompt the caller hashed itself (ChunkKeys.hashes)."""
        return self._held(namespace, {"block_tokens": block_tokens, "chunk_hashes": _hexes(chunk_hashes)})

    def retrieve_chunks(self, namespace: str, chunk_hashes: Sequence[str | bytes],
                        into: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Chunks by hash, in order, from one request (views into one buffer); NotFoundError names the missing.
        `into`: a contiguous uint8 CPU tensor (pinned staging, say) that the response is read into when it
        fits, so a loop of fetches faults no fresh pages in; the chunks returned are then views of it."""
        hashes = _hexes(chunk_hashes)
        if not hashes:
            return []
        if into is not None and (into.dtype != torch.uint8 or into.device.type != "cpu" or not into.is_contiguous()):
            raise ValueError(f"into must be a contiguous uint8 CPU tensor, got {into.dtype} on {into.device}")
        body = json.dumps({"chunk_hashes": hashes}).encode()
        buf, _ = self._download("POST", f"/v1/prefix/{_q(namespace)}/retrieve", body, into)
        items = unpack_batch(memoryview(buf.numpy()))
        if [k for k, *_ in items] != hashes:
            raise CorruptValueError(200, "bad_response", "retrieve answered other chunks than were asked")
        return [value_tensor(buf[o: o + n], d, c, f"{namespace}/chunk/{k}") for k, d, c, o, n in items]

    def store_chunks(self, namespace: str, chunks: Mapping[str | bytes, torch.Tensor]
                     | Iterable[tuple[str | bytes, torch.Tensor]]) -> dict:
        """Store chunks by hash in one request, all or none; the sidecar skips those it holds.
        Returns {"stored": n, "held": n, "nbytes": payload bytes stored}."""
        pairs = list(chunks.items()) if isinstance(chunks, Mapping) else list(chunks)
        hashes, encoded = _hexes([h for h, _ in pairs]), [tensor_bytes(t) for _, t in pairs]
        batch = pack_batch([(h, d, xxhash.xxh3_64_intdigest(v)) for h, (d, v) in zip(hashes, encoded)],
                           [v for _, v in encoded])
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(sum(map(len, batch)))}
        answer = self._call("POST", f"/v1/prefix/{_q(namespace)}/store", content=batch, headers=headers).json()
        return {name: answer[name] for name in ("stored", "held", "nbytes")}

    def delete_chunk(self, namespace: str, chunk_hash: str | bytes) -> None:
        """NotFoundError if the chunk is not stored."""
        self.delete(namespace, chunk_key(*_hexes([chunk_hash])))

    def _held(self, namespace: str, body: dict) -> HeldPrefix:
        answer = self._call("POST", f"/v1/prefix/{_q(namespace)}/lookup", json=body).json()
        return HeldPrefix(answer["num_tokens"], answer["num_chunks"], tuple(answer["chunk_hashes"]))

    # -- service -------------------------------------------------------------------------------
    def stats(self, namespace: str | None = None) -> dict:
        """The service's tiers and totals, or one namespace's {blocks, bytes}."""
        path = "/v1/stats" if namespace is None else f"/v1/namespaces/{_q(namespace)}/stats"
        return self._call("GET", path).json()

    def namespaces(self) -> dict[str, dict]:
        """namespace -> {blocks, bytes} for every namespace that holds values."""
        return self._call("GET", "/v1/namespaces").json()

    def health(self) -> bool:
        try:
            return self.http.get("/healthz").status_code == 200
        except httpx.TransportError:
            return False

    def metrics(self) -> str:
        return self._call("GET", "/metrics").text

    def close(self) -> None:
        self.http.close()
        self.reader.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport -----------------------------------------------------------------------------
    def _call(self, method: str, path: str, **kwargs: object) -> httpx.Response:
        try:
            try:
                response = self.http.request(method, path, **kwargs)
            except _UNANSWERED:
                if method not in _IDEMPOTENT:
                    raise
                response = self.http.request(method, path, **kwargs)  # the dropped connection has left the pool
        except httpx.TransportError as exc:
            raise UnreachableError(0, "unreachable", f"{method} {self.base_url}{path}: {exc!r}") from exc
        if response.status_code >= 300:
            raise error_of(response.status_code, response.content)
        return response

    def _download(self, method: str, path: str, body: bytes | None = None,
                  into: torch.Tensor | None = None) -> tuple[torch.Tensor, Mapping[str, str]]:
        """A binary response as one CPU byte tensor [nbytes] (in `into` when it fits), read with a single copy."""
        try:
            content_type = {"Content-Type": "application/json"} if body is not None else None
            status, headers, content = self.reader.fetch(method, path, body, content_type, into)
        except (OSError, http.client.HTTPException) as exc:
            raise UnreachableError(0, "unreachable", f"{method} {self.base_url}{path}: {exc!r}") from exc
        if status >= 300:
            raise error_of(status, content)
        return content, headers


def tensor_bytes(tensor: torch.Tensor) -> tuple[Descriptor, memoryview]:
    """The descriptor and C-order bytes of a tensor (copied to CPU if needed)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _NAMES:
        raise ValueError(f"unsupported dtype {tensor.dtype}; expected one of {sorted(TORCH_DTYPES)}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return Descriptor(_NAMES[tensor.dtype], tuple(tensor.shape)), memoryview(flat.view(torch.uint8).numpy())


def value_tensor(buf: torch.Tensor, desc: Descriptor, checksum: int | None, what: str) -> torch.Tensor:
    if buf.numel() != desc.nbytes:
        raise CorruptValueError(200, "bad_response", f"{what}: {buf.numel()} bytes for {desc}")
    if checksum is not None and xxhash.xxh3_64_intdigest(memoryview(buf.numpy())) != checksum:
        raise CorruptValueError(200, "bad_response", f"{what}: bytes changed on the way (checksum mismatch)")
    return buf.view(TORCH_DTYPES[desc.dtype]).reshape(desc.shape)


def _hexes(chunk_hashes: Sequence[str | bytes]) -> list[str]:
    out = [h.hex() if isinstance(h, bytes) else h for h in chunk_hashes]
    for h in out:
        check_chunk_hash(h)
    return out


def _q(namespace: str) -> str:
    check_namespace(namespace)  # checked here too: a stray '/' would route the request elsewhere
    return namespace


def _block_url(namespace: str, key: str) -> str:
    check_key(key)
    return f"/v1/namespaces/{_q(namespace)}/blocks/{quote(key, safe='/:@+=~')}"
