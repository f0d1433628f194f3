"""Where KVTierConnector keeps prompt chunks: one small interface, three stores, picked by a URL
(vllm_connector_chunks.open_chunk_store):

    http://host:port, https://...   the kvtier sidecar (`kvtier serve`): tiers.remote.client.Client
    redis://host:port/db, rediss://  Redis, Valkey or a Redis Cluster: engine_adapter.redis_chunks.RedisChunks
    lmdb:///abs/path                 the sidecar's own storage (LMDB + a CPU cache) in this process: LocalChunks

Every store keeps a chunk under the key "chunk/<hash>" of a namespace (tiers/remote/wire.py), with
the sidecar's value format and checksums, so a chunk is found under the same name whichever store
holds it. Errors are tiers.remote.refusals' (NotFoundError, CorruptValueError, UnreachableError, ...)
for every store, so the connector handles one set.

A local store belongs to one process: the scheduler's and the worker's connector of one engine share
it when vLLM runs both in the caller's process (VLLM_ENABLE_V1_MULTIPROCESSING=0); a second process
that opens the same directory is refused (vLLM's default on CPU runs the worker in a process of its
own: refused at startup), since the store's index of held chunks lives in memory and would not see
the other's writes. Engines in several processes share through the sidecar or Redis.
"""

from __future__ import annotations

import fcntl
import os
import threading
from typing import IO, Iterable, Protocol, Sequence

import torch

from kvstore.service.metrics import ServiceMetrics
from kvstore.service.storage import NotFound, ServiceStorage, StorageFull
from kvstore.service.values import Value
from tiers.base import IntegrityError
from tiers.remote.client import HeldPrefix, tensor_bytes, value_tensor
from tiers.remote.refusals import CorruptValueError, NotFoundError, StorageFullError
from tiers.remote.wire import chunk_key, check_chunk_hash, check_namespace

GiB = 1 << 30


class ChunkStore(Protocol):
    """Prompt chunks by chain hash (tiers/keys.py), per namespace."""

    def lookup_chunks(self, namespace: str, chunk_hashes: Sequence[str], block_tokens: int) -> HeldPrefix:
        """How many of the leading chunks are held."""

    def retrieve_chunks(self, namespace: str, chunk_hashes: Sequence[str]) -> list[torch.Tensor]:
        """The chunks, in order, each verified by its checksum (CorruptValueError); NotFoundError names missing ones."""

    def store_chunks(self, namespace: str, chunks: Iterable[tuple[str, torch.Tensor]]) -> dict:
        """Store chunks (each whole or not at all), skipping held ones: {"stored": n, "held": n, "nbytes": n}."""

    def delete_chunk(self, namespace: str, chunk_hash: str) -> None:
        """NotFoundError if the chunk is not held."""

    def close(self) -> None: ...


class LocalChunks:
    """The sidecar's ServiceStorage opened in this process: no HTTP, the same values and checks."""

    # path -> (storage, its owner lock file, users): LMDB allows one open of a file per process, and
    # vLLM builds the scheduler's and the worker's connector (each with its store) separately
    _open: dict[str, tuple[ServiceStorage, IO, int]] = {}
    _open_lock = threading.Lock()

    def __init__(self, path: str, cpu_cache_bytes: int = GiB, ssd_bytes: int = 64 * GiB) -> None:
        if not path or not os.path.isabs(path):
            raise ValueError(f"a local chunk store needs an absolute directory (lmdb:///abs/path), got {path!r}")
        self.path = os.path.realpath(path)
        with self._open_lock:
            if self.path not in self._open:
                self._open[self.path] = (*_open_storage(self.path, cpu_cache_bytes, ssd_bytes), 0)
            storage, lock, users = self._open[self.path]
            self._open[self.path] = (storage, lock, users + 1)
        self.storage = storage
        self.closed = False

    def lookup_chunks(self, namespace: str, chunk_hashes: Sequence[str], block_tokens: int) -> HeldPrefix:
        keys = checked_keys(namespace, chunk_hashes)
        held = self.storage.num_held(namespace, keys)
        return HeldPrefix(held * block_tokens, held, tuple(chunk_hashes[:held]))

    def retrieve_chunks(self, namespace: str, chunk_hashes: Sequence[str]) -> list[torch.Tensor]:
        try:
            values = self.storage.get(namespace, checked_keys(namespace, chunk_hashes))
        except NotFound as exc:
            raise NotFoundError(404, "not_found", str(exc)) from None
        except IntegrityError as exc:
            raise CorruptValueError(500, "integrity_error", str(exc)) from None
        return [chunk_tensor(v, f"{self.path}/{namespace}/chunk/{h}") for h, v in zip(chunk_hashes, values)]

    def store_chunks(self, namespace: str, chunks: Iterable[tuple[str, torch.Tensor]]) -> dict:
        pairs = list(chunks)
        keys = checked_keys(namespace, [h for h, _ in pairs])
        items = [(key, *tensor_bytes(t), None) for key, (_, t) in zip(keys, pairs)]
        try:
            stored, nbytes = self.storage.put_new(namespace, items)
        except StorageFull as exc:
            raise StorageFullError(507, "storage_full", str(exc)) from None
        return {"stored": stored, "held": len(pairs) - stored, "nbytes": nbytes}

    def delete_chunk(self, namespace: str, chunk_hash: str) -> None:
        try:
            self.storage.delete(namespace, checked_keys(namespace, [chunk_hash]))
        except NotFound as exc:
            raise NotFoundError(404, "not_found", str(exc)) from None

    def close(self) -> None:
        """The last user of a directory in this process closes it (and frees it for other processes)."""
        if self.closed:
            return
        self.closed = True
        with self._open_lock:
            storage, lock, users = self._open.pop(self.path)
            if users > 1:
                self._open[self.path] = (storage, lock, users - 1)
                return
        storage.close()
        lock.close()


def _open_storage(path: str, cpu_cache_bytes: int, ssd_bytes: int) -> tuple[ServiceStorage, IO]:
    """ServiceStorage over `path`, which this process then owns: its index of what is held lives in
    memory, so a second process writing the same LMDB file would go unseen (and see stale data)."""
    os.makedirs(path, exist_ok=True)
    lock = open(os.path.join(path, "owner.lock"), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise ValueError(f"local chunk store {path} is open in another process (in vLLM: run scheduler and worker "
                         "in one process, VLLM_ENABLE_V1_MULTIPROCESSING=0); engines in several processes share "
                         "chunks through the sidecar (http://...) or Redis (redis://...)") from None
    try:
        return ServiceStorage(path, cpu_cache_bytes, ssd_bytes, ServiceMetrics(), sync=False), lock
    except BaseException:
        lock.close()
        raise


def chunk_tensor(value: Value, what: str) -> torch.Tensor:
    """A verified value's payload as its own tensor (copied out of the store's buffer)."""
    return value_tensor(torch.frombuffer(bytearray(value.payload), dtype=torch.uint8), value.desc, None, what)


def checked_keys(namespace: str, chunk_hashes: Sequence[str]) -> list[str]:
    """The chunks' keys in `namespace`, both checked (a bad one raises ValueError)."""
    check_namespace(namespace)
    for h in chunk_hashes:
        check_chunk_hash(h)
    return [chunk_key(h) for h in chunk_hashes]
