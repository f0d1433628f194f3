"""Every chunk store KVTierConnector can use (engine_adapter/chunk_store.py), one contract, without vLLM:
the kvtier sidecar (a real `kvtier serve` process), the local store (the sidecar's storage in this
process) and Redis (a real redis-server, and a 3-master cluster). Held prefixes, bit-exact chunks,
held ones skipped, a damaged value refused and recomputed by the connector's load, an unreachable
store."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import lmdb
import pytest
import torch

from engine_adapter.chunk_store import ChunkStore, LocalChunks
from engine_adapter.vllm_connector_chunks import ChunkTransfer, PagedLayers, load, open_chunk_store, save
from tests.kvstore.service.conftest import ServerProcess, free_port
from tests.tiers.redis_servers import raw_client, redis_cluster, redis_single  # noqa: F401  (fixtures)
from tiers.keys import ChunkKeys
from tiers.remote.refusals import CorruptValueError, NotFoundError, UnreachableError

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "vllm-test"
KEYS = ChunkKeys("smollm2-135m|kv=bfloat16", 3, 9, 3, 8, 4)  # 3 layers, 3 kv heads, 4-token blocks
BLOCK_SHAPE = (3, 4, 16)  # one layer's block in vLLM's CPU layout: [kv_heads, block_size, 2 * head_dim]


@dataclass
class Backend:
    store: ChunkStore
    damage: Callable[[str], ChunkStore]  # flip one payload byte of a stored chunk; the store to go on with


def chunks(n: int, seed: int = 0) -> tuple[list[str], list[torch.Tensor]]:
    """n chunk hashes of one prompt and random chunks [num_layers, *BLOCK_SHAPE] in bf16."""
    gen = torch.Generator().manual_seed(seed)
    hashes = KEYS.hashes(torch.randint(0, 50_000, (n * KEYS.block_tokens,), generator=gen).tolist())
    return hashes, [torch.randn(KEYS.num_layers, *BLOCK_SHAPE, generator=gen).to(torch.bfloat16) for _ in range(n)]


def flip_lmdb(data_dir: Path, chunk_hash: str) -> None:
    env = lmdb.open(str(data_dir / "values.lmdb"), subdir=True, map_size=64 << 30)
    with env.begin(write=True) as txn:
        key = f"v/{NAMESPACE}/chunk/{chunk_hash}".encode()
        value = bytearray(txn.get(key))
        value[-7] ^= 0x10
        txn.put(key, bytes(value))
    env.close()


@pytest.fixture(params=["sidecar", "local", "redis", "redis-cluster"])
def backend(request, tmp_path):
    if request.param == "sidecar":
        server = ServerProcess(tmp_path / "sidecar").start()

        def damage_sidecar(chunk_hash: str) -> ChunkStore:
            server.stop()
            flip_lmdb(server.data_dir, chunk_hash)
            server.start(same_port=True)
            return backend.store

        backend = Backend(open_chunk_store(server.url), damage_sidecar)
        yield backend
        backend.store.close()
        server.stop()
    elif request.param == "local":
        url = f"lmdb://{tmp_path / 'local'}"

        def damage_local(chunk_hash: str) -> ChunkStore:
            backend.store.close()
            flip_lmdb(tmp_path / "local", chunk_hash)
            backend.store = open_chunk_store(url)
            return backend.store

        backend = Backend(open_chunk_store(url), damage_local)
        yield backend
        backend.store.close()
    else:
        server = request.getfixturevalue("redis_single" if request.param == "redis" else "redis_cluster")
        client = raw_client(server.url)
        client.flushdb()

        def damage_redis(chunk_hash: str) -> ChunkStore:
            key = f"{NAMESPACE}/chunk/{chunk_hash}"
            value = bytearray(client.get(key))
            value[-7] ^= 0x10
            client.set(key, bytes(value))
            return backend.store

        backend = Backend(open_chunk_store(server.url), damage_redis)
        yield backend
        backend.store.close()
        client.close()


def test_held_prefix_bit_exact_chunks_and_held_ones_skipped(backend):
    store = backend.store
    hashes, tensors = chunks(5)
    assert store.lookup_chunks(NAMESPACE, hashes, KEYS.block_tokens).num_chunks == 0
    answer = store.store_chunks(NAMESPACE, [(hashes[i], tensors[i]) for i in (0, 1, 2, 4)])
    assert answer == {"stored": 4, "held": 0, "nbytes": 4 * tensors[0].numel() * 2}
    held = store.lookup_chunks(NAMESPACE, hashes, KEYS.block_tokens)  # chunk 3 is missing: the prefix ends there
    assert (held.num_chunks, held.num_tokens, list(held.chunk_hashes)) == (3, 3 * KEYS.block_tokens, hashes[:3])
    assert store.store_chunks(NAMESPACE, zip(hashes, tensors)) == {"stored": 1, "held": 4,
                                                                  "nbytes": tensors[0].numel() * 2}
    got = store.retrieve_chunks(NAMESPACE, hashes[::-1])
    for a, b in zip(got, tensors[::-1]):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert store.lookup_chunks("another-ns", hashes, KEYS.block_tokens).num_chunks == 0
    other, _ = chunks(1, seed=1)
    with pytest.raises(NotFoundError):
        store.retrieve_chunks(NAMESPACE, [hashes[0], other[0]])
    store.delete_chunk(NAMESPACE, hashes[1])
    assert store.lookup_chunks(NAMESPACE, hashes, KEYS.block_tokens).num_chunks == 1
    with pytest.raises(NotFoundError):
        store.delete_chunk(NAMESPACE, hashes[1])
    with pytest.raises(ValueError):
        store.lookup_chunks(NAMESPACE, ["not-a-hash"], KEYS.block_tokens)


def test_damaged_chunk_is_refused_and_the_connector_recomputes_it(backend):
    hashes, tensors = chunks(4, seed=2)
    source = PagedLayers({f"layer{i}": torch.randn(8, *BLOCK_SHAPE).to(torch.bfloat16) for i in range(3)})
    assert save(backend.store, NAMESPACE, source, [ChunkTransfer("a", [5, 1], hashes[:2]),
                                                   ChunkTransfer("b", [6, 2], hashes[2:])]) == 4
    assert save(backend.store, NAMESPACE, source, [ChunkTransfer("a", [5, 1], hashes[:2])]) == 0  # held

    target = PagedLayers({f"layer{i}": torch.zeros(8, *BLOCK_SHAPE, dtype=torch.bfloat16) for i in range(3)})
    assert load(backend.store, NAMESPACE, target, ChunkTransfer("c", [0, 3, 4, 7], hashes)) == set()
    for src, dst in zip(source.layers, target.layers):
        assert torch.equal(dst[[0, 3, 4, 7]], src[[5, 1, 6, 2]])

    store = backend.damage(hashes[2])
    with pytest.raises(CorruptValueError):
        store.retrieve_chunks(NAMESPACE, [hashes[2]])
    fresh = PagedLayers({f"layer{i}": torch.zeros(8, *BLOCK_SHAPE, dtype=torch.bfloat16) for i in range(3)})
    assert load(store, NAMESPACE, fresh, ChunkTransfer("d", [0, 3, 4, 7], hashes)) == {4}  # only the damaged one
    assert all(not layer[4].any() for layer in fresh.layers)  # left for vLLM to recompute
    assert all(torch.equal(f[7], s[2]) for f, s in zip(fresh.layers, source.layers))
    assert store.lookup_chunks(NAMESPACE, hashes, KEYS.block_tokens).num_chunks == 2  # the damaged one is deleted
    assert save(store, NAMESPACE, source, [ChunkTransfer("b", [6, 2], hashes[2:])]) == 1  # stored again
    assert store.lookup_chunks(NAMESPACE, hashes, KEYS.block_tokens).num_chunks == 4


@pytest.mark.parametrize("scheme", ["http", "redis"])  # a local store is in this process: never unreachable
def test_unreachable_store_holds_nothing_and_fails_loads(scheme):
    hashes, tensors = chunks(2, seed=3)
    dead = open_chunk_store(f"{scheme}://127.0.0.1:{free_port()}", timeout_s=1.0)  # opening connects to nothing
    with pytest.raises(UnreachableError):
        dead.lookup_chunks(NAMESPACE, hashes, KEYS.block_tokens)
    with pytest.raises(UnreachableError):
        dead.store_chunks(NAMESPACE, zip(hashes, tensors))
    paged = PagedLayers({"layer0": torch.zeros(4, *BLOCK_SHAPE, dtype=torch.bfloat16)})
    assert load(dead, NAMESPACE, paged, ChunkTransfer("r", [1, 2], hashes)) == {1, 2}
    assert save(dead, NAMESPACE, paged, [ChunkTransfer("r", [1, 2], hashes)]) == 0  # dropped, not raised
    dead.close()


def test_local_store_is_shared_within_a_process_and_refused_to_another(tmp_path):
    path = tmp_path / "local"
    scheduler, worker = LocalChunks(str(path)), LocalChunks(str(path))  # vLLM's two sides of one engine
    hashes, tensors = chunks(2, seed=4)
    worker.store_chunks(NAMESPACE, zip(hashes, tensors))
    assert scheduler.lookup_chunks(NAMESPACE, hashes, KEYS.block_tokens).num_chunks == 2
    probe = [sys.executable, "-c", f"from engine_adapter.chunk_store import LocalChunks; LocalChunks({str(path)!r})"]
    other = subprocess.run(probe, cwd=REPO, capture_output=True, text=True)
    assert other.returncode != 0 and "open in another process" in other.stderr
    scheduler.close()
    assert worker.lookup_chunks(NAMESPACE, hashes, KEYS.block_tokens).num_chunks == 2  # still open for the worker
    worker.close()
    assert subprocess.run(probe, cwd=REPO, capture_output=True, text=True).returncode == 0
    reopened = LocalChunks(str(path))
    assert torch.equal(reopened.retrieve_chunks(NAMESPACE, hashes[1:])[0].view(torch.int16), tensors[1].view(torch.int16))
    reopened.close()


def test_store_url_picks_the_store():
    with pytest.raises(ValueError, match="must start with"):
        open_chunk_store("ftp://example.org/x")
    with pytest.raises(ValueError, match="absolute directory"):
        open_chunk_store("lmdb://relative/path")
