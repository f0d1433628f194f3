"""The /v1/prefix routes over real HTTP: lookup of a prompt's held chunks, retrieve and store by hash."""

from __future__ import annotations

import httpx
import pytest
import torch

from kvstore.config import ModelSpec
from kvstore.contexts.sequences import chain_root
from tests.kvstore.service.conftest import TOKEN, random_tensor, same_bits
from tiers.keys import ChunkKeys, chain_hashes
from tiers.remote.client import AuthError, Client, NotFoundError
from tiers.remote.wire import Descriptor, pack_batch

KEYS = ChunkKeys("smollm2-135m", num_layers=3, num_q_heads=9, num_kv_heads=3, head_dim=64, block_tokens=16)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 49_152, (n,), generator=g).tolist()


def chunk(seed: int) -> torch.Tensor:
    shape = (KEYS.num_layers, 2, KEYS.num_kv_heads, KEYS.block_tokens, 8)  # [L, 2, H, B, D]
    return random_tensor(torch.float16, shape, seed)


@pytest.fixture
def client(server):
    with Client(server.url) as c:
        yield c


def test_the_client_hashes_prompts_as_the_store_keys_its_blocks():
    spec = ModelSpec(num_layers=3, num_q_heads=9, num_kv_heads=3, head_dim=64)
    ids = prompt(100, seed=1)
    store_chain = chain_hashes(chain_root("smollm2-135m", spec, 16), ids, 16)
    assert KEYS.hashes(ids) == [h.hex() for h in store_chain] and len(store_chain) == 6  # 100 // 16 full blocks
    other = ChunkKeys("smollm2-360m", 3, 9, 3, 64, 16)
    assert not set(other.hashes(ids)) & set(KEYS.hashes(ids))  # another model never shares a key


def test_lookup_counts_the_leading_held_chunks_and_a_diverging_token_ends_it(client):
    ns = "prefix-lookup"
    ids = prompt(16 * 8 + 5, seed=2)  # 8 full chunks and a partial one
    hashes = KEYS.hashes(ids)
    assert client.lookup_prefix(ns, ids, KEYS).num_tokens == 0
    client.store_chunks(ns, [(h, chunk(i)) for i, h in enumerate(hashes[:5])])
    held = client.lookup_prefix(ns, ids, KEYS)
    assert (held.num_tokens, held.num_chunks, held.chunk_hashes) == (5 * 16, 5, tuple(hashes[:5]))
    assert client.lookup_chunks(ns, hashes, block_tokens=16) == held
    by_server = post(client.base_url, f"{ns}/lookup",  # the server hashes token ids itself
                     json={"block_tokens": 16, "token_ids": ids, "model": KEYS.model()}).json()
    assert by_server == {"num_tokens": 80, "num_chunks": 5, "chunk_hashes": hashes[:5]}
    diverged = list(ids)
    diverged[3 * 16 + 7] += 1  # a token inside chunk 3 changes chunk 3's hash and every later one
    assert client.lookup_prefix(ns, diverged, KEYS).num_tokens == 3 * 16
    client.store_chunks(ns, {hashes[6]: chunk(6)})  # chunk 6 held, chunk 5 not: the match still ends at 5
    assert client.lookup_prefix(ns, ids, KEYS).num_tokens == 5 * 16
    assert client.lookup_prefix(ns, ids[:16 * 4 + 3], KEYS).num_tokens == 4 * 16
    assert client.lookup_prefix(ns, ids, ChunkKeys("other-model", 3, 9, 3, 64, 16)).num_tokens == 0


def test_retrieve_is_bit_exact_and_store_keeps_each_chunk_once(client):
    ns = "prefix-fetch"
    hashes = KEYS.hashes(prompt(16 * 6, seed=3))
    chunks = {h: chunk(10 + i) for i, h in enumerate(hashes)}
    assert client.store_chunks(ns, list(chunks.items())[:4]) == {"stored": 4, "held": 0,
                                                                 "nbytes": 4 * chunks[hashes[0]].numel() * 2}
    before = client.stats(ns)
    again = client.store_chunks(ns, chunks)  # 4 held, 2 new
    assert (again["stored"], again["held"]) == (2, 4)
    assert client.stats(ns)["blocks"] == before["blocks"] + 2
    got = client.retrieve_chunks(ns, hashes[::-1])
    assert all(same_bits(g, chunks[h]) for g, h in zip(got, hashes[::-1]))
    assert same_bits(client.retrieve_chunks(ns, [bytes.fromhex(hashes[2])])[0], chunks[hashes[2]])
    missing = KEYS.hashes(prompt(16, seed=99))[0]
    with pytest.raises(NotFoundError, match=missing):
        client.retrieve_chunks(ns, [hashes[0], missing])


def test_retrieve_into_a_staging_buffer_fills_it_and_falls_back_when_it_is_too_small(client):
    ns = "prefix-into"
    hashes = KEYS.hashes(prompt(16 * 3, seed=7))
    chunks = {h: chunk(20 + i) for i, h in enumerate(hashes)}
    client.store_chunks(ns, chunks)
    staging = torch.full((1 << 20,), 7, dtype=torch.uint8)  # [bytes]
    got = client.retrieve_chunks(ns, hashes, into=staging)
    assert all(same_bits(g, chunks[h]) for g, h in zip(got, hashes))
    assert all(g.untyped_storage().data_ptr() == staging.untyped_storage().data_ptr() for g in got)
    small = torch.zeros(100, dtype=torch.uint8)
    got = client.retrieve_chunks(ns, hashes[:1], into=small)
    assert same_bits(got[0], chunks[hashes[0]]) and small.eq(0).all()  # read into a new buffer instead
    with pytest.raises(ValueError, match="uint8"):
        client.retrieve_chunks(ns, hashes, into=torch.zeros(1 << 20, dtype=torch.float16))


def post(url: str, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}/v1/prefix/{path}", **kwargs)


@pytest.mark.parametrize("body, words", [
    ({"block_tokens": 16, "token_ids": [1, 2]}, "model identity"),
    ({"block_tokens": 16}, "exactly one"),
    ({"block_tokens": 16, "token_ids": [1], "model": KEYS.model(), "chunk_hashes": []}, "exactly one"),
    ({"block_tokens": 16, "token_ids": [1, -2], "model": KEYS.model()}, "token_ids"),
    ({"block_tokens": 0, "chunk_hashes": []}, "block_tokens"),
    ({"block_tokens": 16, "chunk_hashes": ["ABC"]}, "chunk"),
    ({"block_tokens": 16, "token_ids": [1], "model": {**KEYS.model(), "head_dim": 0}}, "head_dim"),
])
def test_bad_lookups_are_400_naming_the_problem(server, body, words):
    r = post(server.url, "bad/lookup", json=body)
    assert r.status_code == 400 and r.json()["error"] == "bad_request" and words in r.json()["detail"], r.text


def test_bad_stores_and_retrieves_are_4xx_and_change_nothing(client, server):
    ns = "prefix-bad"
    good = KEYS.hashes(prompt(32, seed=4))
    payload = chunk(1).reshape(-1).view(torch.uint8).numpy().tobytes()
    desc = Descriptor("float16", tuple(chunk(1).shape))

    def body(key: str, checksum: int | None = None, data: bytes = payload) -> bytes:
        return b"".join(pack_batch([(key, desc, checksum)], [data]))

    for broken, status in ((body("not-a-hash"), 400), (body(good[0].upper()), 400),
                           (body(good[0], checksum=12345), 400), (body(good[0])[:-1], 400),
                           (body(good[0], data=bytes(len(payload) - 2)) + b"xx", 400)):
        r = post(server.url, f"{ns}/store", content=broken)
        assert r.status_code == status and r.json()["error"], r.text
    assert client.keys(ns) == [] and client.lookup_chunks(ns, good, 16).num_chunks == 0
    with pytest.raises(ValueError, match="32 lowercase hex"):
        client.retrieve_chunks(ns, ["xyz"])  # refused by the client before it is sent
    r = post(server.url, f"{ns}/retrieve", json={"chunk_hashes": ["../../etc"]})
    assert r.status_code == 400
    r = post(server.url, f"{ns}/retrieve", json={"chunk_hashes": good})
    assert r.status_code == 404 and good[0] in r.json()["detail"]
    assert post(server.url, "bad!ns/lookup", json={"block_tokens": 16, "chunk_hashes": []}).status_code == 400
    r = post(server.url, f"{ns}/store", content=bytes(17 << 20))  # the shared server's 16M body limit
    assert r.status_code == 413
    assert client.keys(ns) == []


def test_prefix_routes_need_the_token(guarded):
    ids = prompt(64, seed=5)
    lookup = {"block_tokens": 16, "token_ids": ids, "model": KEYS.model()}
    for path, kwargs in (("ns/lookup", {"json": lookup}), ("ns/retrieve", {"json": {"chunk_hashes": []}}),
                         ("ns/store", {"content": b"\0" * 8})):
        assert post(guarded.url, path, **kwargs).status_code == 401, path
        r = post(guarded.url, path, headers={"Authorization": "Bearer wrong"}, **kwargs)
        assert r.status_code == 401 and r.json()["error"] == "unauthorized", path
    with Client(guarded.url) as anonymous, pytest.raises(AuthError):
        anonymous.lookup_prefix("ns", ids, KEYS)
    with Client(guarded.url, token=TOKEN) as c:  # its own namespace: other tests expect "ns" of this server empty
        c.store_chunks("prefix-auth", {KEYS.hashes(ids)[0]: chunk(2)})
        assert c.lookup_prefix("prefix-auth", ids, KEYS).num_tokens == 16
        c.drop_namespace("prefix-auth")


def test_prefix_metrics_are_named_like_lmcaches(client):
    ns = "prefix-metrics"
    ids = prompt(16 * 4, seed=6)
    hashes = KEYS.hashes(ids)

    def value(text: str, name: str) -> float:
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
                   or line.startswith(name + "{"))

    before = client.metrics()
    client.store_chunks(ns, {h: chunk(i) for i, h in enumerate(hashes[:3])})
    client.store_chunks(ns, {hashes[0]: chunk(0)})
    client.lookup_prefix(ns, ids, KEYS)
    client.retrieve_chunks(ns, hashes[:3])
    after = client.metrics()
    delta = {name: value(after, name) - value(before, name) for name in (
        "kvtier_lookup_requests_total", "kvtier_lookup_tokens_total", "kvtier_lookup_hit_tokens_total",
        "kvtier_retrieve_seconds_count", "kvtier_store_seconds_count", "kvtier_retrieve_blocks_total")}
    assert delta == {"kvtier_lookup_requests_total": 1, "kvtier_lookup_tokens_total": 64,
                     "kvtier_lookup_hit_tokens_total": 48, "kvtier_retrieve_seconds_count": 1,
                     "kvtier_store_seconds_count": 2, "kvtier_retrieve_blocks_total": 3}
    assert 'kvtier_store_blocks_total{result="held"}' in after


def test_openapi_documents_the_prefix_routes(server):
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    lookup = paths["/v1/prefix/{namespace}/lookup"]["post"]
    assert {"200", "400", "413"} <= set(lookup["responses"])
    assert "application/octet-stream" in paths["/v1/prefix/{namespace}/retrieve"]["post"]["responses"]["200"]["content"]
    assert "application/octet-stream" in paths["/v1/prefix/{namespace}/store"]["post"]["requestBody"]["content"]
    schemas = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    assert {"token_ids", "chunk_hashes", "model", "block_tokens"} <= set(schemas["LookupRequest"]["properties"])
    assert set(schemas["StoredChunks"]["properties"]) == {"namespace", "stored", "held", "nbytes"}
