"""What KVTierConnector moves, without vLLM: a request's chunk plan, and the copies between vLLM's
paged KV tensors and a chunk store (the sidecar, Redis or a local one: engine_adapter/chunk_store.py).

One chunk is one vLLM block of every layer: `[num_layers, *block_shape]`, where block_shape is one
block of one layer's paged tensor (`[kv_heads, block_size, 2 * head_dim]` on vLLM's CPU backend).
It is named by the chain hash of the prompt up to and including that block (tiers/keys.py), so a
second engine, on another host, finds it in a shared store from the token ids alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence
from urllib.parse import urlsplit

import torch

from engine_adapter.chunk_store import ChunkStore, GiB, LocalChunks
from tiers.keys import ChunkKeys
from tiers.remote.client import Client
from tiers.remote.refusals import CorruptValueError, NotFoundError, ServiceError

log = logging.getLogger(__name__)


def open_chunk_store(url: str, token: str | None = None, timeout_s: float = 5.0, cpu_cache_bytes: int = GiB,
                     ssd_bytes: int = 64 * GiB) -> ChunkStore:
    """The store a URL names (engine_adapter/chunk_store.py); `token` is the sidecar's, the sizes a local store's."""
    parts = urlsplit(url)
    scheme = parts.scheme
    if scheme in ("http", "https"):
        return Client(url, token=token, timeout=timeout_s)
    if scheme in ("redis", "rediss"):
        from engine_adapter.redis_chunks import RedisChunks  # needs the redis package

        return RedisChunks(url, timeout_s=timeout_s)
    if scheme == "lmdb":
        return LocalChunks("" if parts.netloc else parts.path, cpu_cache_bytes, ssd_bytes)  # lmdb://x/y: not absolute
    raise ValueError(f"chunk store URL must start with http(s)://, redis(s):// or lmdb:///, got {url!r}")


@dataclass(slots=True)
class ChunkTransfer:
    """Chunks to move for one request: vLLM block ids and the chunk hashes they hold, pairwise."""

    req_id: str
    block_ids: list[int]
    chunk_hashes: list[str]

    def __post_init__(self) -> None:
        if len(self.block_ids) != len(self.chunk_hashes):
            raise ValueError(f"{self.req_id}: {len(self.block_ids)} block ids for {len(self.chunk_hashes)} chunks")


@dataclass(slots=True)
class RequestPlan:
    """The scheduler's record of one request: its prompt's chunk hashes and how many of its leading
    chunks are in the store already (loaded from it, or saved by an earlier step)."""

    chunk_hashes: list[str]
    num_held: int = 0  # leading chunks known to be in the store: never saved again
    num_loading: int = 0  # of those, the chunks this request loads (set once blocks are allocated)
    loads_from: int = 0  # first chunk to load (the ones before it vLLM had cached itself)

    def saves(self, req_id: str, num_done_tokens: int, block_size: int, block_ids: Sequence[int]) -> ChunkTransfer:
        """The chunks that are full once `num_done_tokens` tokens are computed and were not saved yet."""
        num_full = min(num_done_tokens // block_size, len(self.chunk_hashes), len(block_ids))
        start, self.num_held = self.num_held, max(self.num_held, num_full)
        return ChunkTransfer(req_id, list(block_ids[start:num_full]), self.chunk_hashes[start:num_full])


@dataclass(slots=True)
class StepPlan:
    """One step's loads and saves: what the scheduler hands the workers."""

    loads: list[ChunkTransfer] = field(default_factory=list)
    saves: list[ChunkTransfer] = field(default_factory=list)


def lookup(store: ChunkStore, namespace: str, keys: ChunkKeys, prompt_token_ids: Sequence[int]
           ) -> tuple[list[str], int]:
    """(hashes of the prompt's full chunks, how many leading ones the store holds). Never counts a chunk
    holding the last prompt token: vLLM must compute that one to get logits. A store that cannot be
    reached holds nothing."""
    hashes = keys.hashes(prompt_token_ids)
    num_claimable = (len(prompt_token_ids) - 1) // keys.block_tokens
    if num_claimable <= 0:
        return hashes, 0
    try:
        return hashes, store.lookup_chunks(namespace, hashes[:num_claimable], keys.block_tokens).num_chunks
    except ServiceError as exc:
        log.warning("kvtier lookup failed, the prompt is computed instead: %s", exc)
        return hashes, 0


class PagedLayers:
    """vLLM's per-layer paged KV tensors, blocks first: `{layer_name: [num_blocks, *block_shape]}`."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int | None = None) -> None:
        if not kv_caches:
            raise ValueError("no KV cache tensors to register")
        self.layers = list(kv_caches.values())  # the model's layer order, as vLLM registers them
        first = self.layers[0]
        for name, kv in kv_caches.items():
            if kv.shape != first.shape or kv.dtype != first.dtype:
                raise ValueError(f"layer {name}: {tuple(kv.shape)} {kv.dtype}, expected every layer like the "
                                 f"first: {tuple(first.shape)} {first.dtype}")
        if num_blocks is not None and first.shape[0] != num_blocks:
            raise ValueError(f"the KV cache must be blocks first: dim 0 is {first.shape[0]}, expected the "
                             f"{num_blocks} blocks vLLM allocated (only blocks-first layouts are supported)")
        self.chunk_shape = (len(self.layers), *first.shape[1:])
        self.dtype = first.dtype

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Chunks of `block_ids` on CPU: `[n, num_layers, *block_shape]`."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.layers[0].device)
        return torch.stack([kv.index_select(0, index) for kv in self.layers], dim=1).cpu()

    def scatter(self, block_id: int, chunk: torch.Tensor) -> None:
        if tuple(chunk.shape) != self.chunk_shape or chunk.dtype != self.dtype:
            raise CorruptValueError(0, "bad_chunk", f"chunk {tuple(chunk.shape)} {chunk.dtype}, "
                                                    f"expected {self.chunk_shape} {self.dtype}")
        for layer, kv in enumerate(self.layers):
            kv[block_id].copy_(chunk[layer], non_blocking=True)


def load(store: ChunkStore, namespace: str, paged: PagedLayers, transfer: ChunkTransfer) -> set[int]:
    """Copy a request's chunks into its vLLM blocks; returns the block ids that could not be loaded
    (missing, damaged or of another shape): those blocks are left as they were, for vLLM to recompute.
    A damaged chunk is also deleted from the store, so a later save replaces it."""
    if not transfer.chunk_hashes:
        return set()
    try:
        chunks = store.retrieve_chunks(namespace, transfer.chunk_hashes)
    except (CorruptValueError, NotFoundError) as exc:  # one bad chunk fails the whole batch: find which
        log.warning("kvtier load of %d chunks failed (%s); retrying chunk by chunk", len(transfer.block_ids), exc)
        chunks = [None] * len(transfer.chunk_hashes)
    except ServiceError as exc:  # unreachable, say: every block is recomputed
        log.warning("kvtier load of %d chunks failed, they are recomputed: %s", len(transfer.block_ids), exc)
        return set(transfer.block_ids)
    failed: set[int] = set()
    for block_id, chunk_hash, chunk in zip(transfer.block_ids, transfer.chunk_hashes, chunks):
        try:
            if chunk is None:
                (chunk,) = store.retrieve_chunks(namespace, [chunk_hash])
            paged.scatter(block_id, chunk)
        except CorruptValueError as exc:
            log.warning("kvtier chunk %s is damaged, block %d is recomputed: %s", chunk_hash, block_id, exc)
            failed.add(block_id)
            _delete_quietly(store, namespace, chunk_hash)
        except ServiceError as exc:  # missing (evicted, deleted) or unreachable
            log.warning("kvtier chunk %s not loaded, block %d is recomputed: %s", chunk_hash, block_id, exc)
            failed.add(block_id)
    return failed


def save(store: ChunkStore, namespace: str, paged: PagedLayers, transfers: Sequence[ChunkTransfer]) -> int:
    """Store the transfers' chunks in one call (chunks the store holds are skipped); returns the
    number stored. A failed save is logged and dropped: it costs a later miss, never a wrong block."""
    block_ids = [b for t in transfers for b in t.block_ids]
    if not block_ids:
        return 0
    hashes = [h for t in transfers for h in t.chunk_hashes]
    chunks = paged.gather(block_ids)  # [n, num_layers, *block_shape]
    try:
        return store.store_chunks(namespace, list(zip(hashes, chunks)))["stored"]
    except (ServiceError, ValueError) as exc:
        log.warning("kvtier save of %d chunks dropped: %s", len(hashes), exc)
        return 0


def _delete_quietly(store: ChunkStore, namespace: str, chunk_hash: str) -> None:
    try:
        store.delete_chunk(namespace, chunk_hash)
    except ServiceError as exc:
        log.warning("kvtier could not delete damaged chunk %s: %s", chunk_hash, exc)
