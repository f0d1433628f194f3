"""Prompt chunks in Redis (Valkey, Redis Cluster): KVTierConnector's store for engines on many hosts.

    key    <namespace>/chunk/<hash>     (engine_adapter/chunk_store.py: the name every store uses)
    value  the sidecar's stored form (kvstore/service/values.py): header with dtype, shape and the
           key itself, the payload, xxh3-64 checksums of both; verified on every read

One key, one value, one command: Redis evicts a chunk whole or not at all. A store is SET NX per
chunk (a held chunk is skipped: its hash names its content), pipelined; a chunk stored by another
engine, on another host, is found by its hash alone. Nothing is ever deleted but a damaged chunk;
Redis's maxmemory policy removes the rest. The connection is opened on first use, so an engine
starts while Redis is down and computes its prompts until it is back.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable, Sequence

import torch
import xxhash

from engine_adapter.chunk_store import checked_keys, chunk_tensor
from kvstore.service.values import ValueCodec
from tiers.base import IntegrityError
from tiers.remote.client import HeldPrefix, tensor_bytes
from tiers.remote.refusals import CorruptValueError, NotFoundError, StorageFullError, UnreachableError
from tiers.redis_wire import connect, pipelined

PIPELINE_KEYS = 8  # commands per pipeline: 8 chunks of a 128-token vLLM block of SmolLM2-135M are 24 MB


class RedisChunks:
    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._client = None
        self._local = threading.local()  # a ValueCodec per thread (zstd contexts are not shared)

    def lookup_chunks(self, namespace: str, chunk_hashes: Sequence[str], block_tokens: int) -> HeldPrefix:
        found = self._run(self.keys(namespace, chunk_hashes), lambda pipe, key, _: pipe.exists(key))
        held = next((i for i, n in enumerate(found) if n != 1), len(found))
        return HeldPrefix(held * block_tokens, held, tuple(chunk_hashes[:held]))

    def retrieve_chunks(self, namespace: str, chunk_hashes: Sequence[str]) -> list[torch.Tensor]:
        keys = self.keys(namespace, chunk_hashes)
        values = self._run(keys, lambda pipe, key, _: pipe.get(key))
        missing = [h for h, v in zip(chunk_hashes, values) if v is None]
        if missing:
            raise NotFoundError(404, "not_found", f"{self.url} namespace {namespace!r}: {len(missing)} chunk(s) "
                                                  f"not held (evicted?): {missing[:8]}")
        chunks = []
        for key, value in zip(keys, values):
            what = f"{self.url} {key.decode()}"
            try:
                if isinstance(value, Exception):  # WRONGTYPE: something else lives under the key
                    raise IntegrityError(f"{what}: {value}")
                chunks.append(chunk_tensor(self.codec().decode(value, what, key), what))
            except IntegrityError as exc:
                raise CorruptValueError(0, "integrity_error", str(exc)) from None
        return chunks

    def store_chunks(self, namespace: str, chunks: Iterable[tuple[str, torch.Tensor]]) -> dict:
        pairs = list(chunks)
        keys = self.keys(namespace, [h for h, _ in pairs])
        values, sizes = [], []
        for key, (_, tensor) in zip(keys, pairs):
            desc, payload = tensor_bytes(tensor)
            values.append(self.codec().encode(desc, payload, xxhash.xxh3_64_intdigest(payload), key))
            sizes.append(len(payload))
        answers = self._run(keys, lambda pipe, key, value: pipe.set(key, value, nx=True), values)
        refused = [a for a in answers if isinstance(a, Exception)]
        if refused:  # OOM (maxmemory with noeviction) or WRONGTYPE; the chunks before it are stored, whole
            raise StorageFullError(507, "storage_full", f"{self.url}: {refused[0]}")
        return {"stored": sum(1 for a in answers if a), "held": sum(1 for a in answers if not a),
                "nbytes": sum(n for n, a in zip(sizes, answers) if a)}

    def delete_chunk(self, namespace: str, chunk_hash: str) -> None:
        (deleted,) = self._run(self.keys(namespace, [chunk_hash]), lambda pipe, key, _: pipe.delete(key))
        if not deleted:
            raise NotFoundError(404, "not_found", f"{self.url} namespace {namespace!r}: no chunk {chunk_hash}")

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    @staticmethod
    def keys(namespace: str, chunk_hashes: Sequence[str]) -> list[bytes]:
        return [f"{namespace}/{key}".encode() for key in checked_keys(namespace, chunk_hashes)]

    def codec(self) -> ValueCodec:
        if not hasattr(self._local, "codec"):
            self._local.codec = ValueCodec()
        return self._local.codec

    def _run(self, keys: list[bytes], command: Callable, values: Sequence | None = None) -> list:
        """command(pipe, key, value) per key (tiers/redis_wire.py); Redis down raises UnreachableError."""
        if self._client is None:
            try:
                self._client, _ = connect(self.url, self.timeout_s)
            except ValueError as exc:  # no Redis answers there
                raise UnreachableError(0, "unreachable", str(exc)) from None
        try:
            return pipelined(self._client, self.url, keys, command, values, PIPELINE_KEYS)
        except ConnectionError as exc:
            raise UnreachableError(0, "unreachable", str(exc)) from None
