"""The sidecar over real HTTP: bit-exact round trips, batches, listing, isolation, bad input."""

from __future__ import annotations

import httpx
import pytest
import torch

from tiers.remote.client import Client, NotFoundError, StorageFullError
from tiers.remote.wire import Descriptor, pack_batch
from tests.kvstore.service.conftest import random_tensor, same_bits
from tiers.layout import BlockLayout
from tiers.quant import quantize

SHAPES = [(2, 3, 5, 7), (2, 1, 16, 64), (1,), (3, 17), (), (0, 4)]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.uint8, torch.int32]


@pytest.fixture
def client(server):
    with Client(server.url) as c:
        yield c


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_and_shape_round_trips_bit_exact(client, dtype):
    ns = f"rt-{str(dtype).split('.')[1]}"
    tensors = {f"t/{i}": random_tensor(dtype, shape, seed=i) for i, shape in enumerate(SHAPES)}
    for key, t in tensors.items():
        client.put(ns, key, t)
    for key, t in tensors.items():
        assert same_bits(client.get(ns, key), t), key
    got = client.get_many(ns, list(tensors)[::-1])
    assert all(same_bits(g, tensors[k]) for g, k in zip(got, list(tensors)[::-1]))


def test_fp16_and_int8_blocks_in_one_batch(client):
    layout = BlockLayout(num_kv_heads=3, block_tokens=16, head_dim=40)
    fp16 = random_tensor(torch.float16, (5, *layout.shape), seed=7)  # [n, 2, H, B, D]
    int8 = quantize(fp16)
    items = [(f"blk/{i}", fp16[i]) for i in range(5)]
    items += [(f"q/{i}/{name}", t[i]) for i in range(5) for name, t in zip(("d", "k", "v"), int8.tensors())]
    client.put_many("blocks", items)
    keys = [k for k, _ in items]
    got = client.get_many("blocks", keys)
    assert all(same_bits(g, t) for g, (_, t) in zip(got, items))
    assert client.keys("blocks", prefix="q/3/") == ["q/3/d", "q/3/k", "q/3/v"]
    assert client.stats("blocks")["blocks"] == 20


def test_overwrite_delete_and_listing(client):
    ns = "life"
    client.put(ns, "a/1", random_tensor(torch.float32, (4, 4), seed=1))
    new = random_tensor(torch.int32, (9,), seed=2)
    client.put(ns, "a/1", new)  # replaces, with another dtype and shape
    assert same_bits(client.get(ns, "a/1"), new)
    client.put_many(ns, {f"b/{i:03d}": random_tensor(torch.int8, (i + 1,), seed=i) for i in range(12)})
    assert client.keys(ns, "b/") == [f"b/{i:03d}" for i in range(12)]
    page = httpx.get(f"{client.base_url}/v1/namespaces/{ns}/keys", params={"prefix": "b/", "limit": 5}).json()
    assert page == {"keys": [f"b/{i:03d}" for i in range(5)], "truncated": True}
    client.delete(ns, "a/1")
    with pytest.raises(NotFoundError, match="a/1"):
        client.get(ns, "a/1")
    assert client.delete_many(ns, ["b/000", "b/001"]) == 2
    with pytest.raises(NotFoundError, match="b/000"):
        client.delete_many(ns, ["b/002", "b/000"])  # all or nothing
    assert client.keys(ns, "b/")[0] == "b/002"
    assert client.stats(ns) == {"namespace": ns, "blocks": 10, "bytes": client.stats(ns)["bytes"]}
    assert client.drop_namespace(ns) == 10 and client.keys(ns) == []


def test_namespaces_are_isolated(client):
    a, b = random_tensor(torch.float16, (8,), seed=1), random_tensor(torch.float16, (8,), seed=2)
    client.put("tenant-a", "shared/key", a)
    client.put("tenant-ab", "shared/key", b)  # a namespace that extends another's name
    with pytest.raises(NotFoundError):
        client.get("tenant-b", "shared/key")
    assert same_bits(client.get("tenant-a", "shared/key"), a)
    assert same_bits(client.get("tenant-ab", "shared/key"), b)
    assert client.keys("tenant-a") == ["shared/key"] and client.keys("tenant-b") == []
    client.drop_namespace("tenant-a")
    assert same_bits(client.get("tenant-ab", "shared/key"), b)
    assert "tenant-ab" in client.namespaces() and "tenant-a" not in client.namespaces()


def raw_put(url: str, body: bytes, **headers: str) -> httpx.Response:
    base = {"x-kvtier-dtype": "float16", "x-kvtier-shape": "2,3", "x-kvtier-layout": "1"}
    return httpx.put(f"{url}/v1/namespaces/bad/blocks/k", content=body, headers={**base, **headers})


@pytest.mark.parametrize("headers, body, status, words", [
    ({"x-kvtier-dtype": "float64"}, bytes(12), 400, "unsupported dtype"),
    ({"x-kvtier-shape": "2,x"}, bytes(12), 400, "x-kvtier-shape"),
    ({"x-kvtier-shape": "-2,3"}, bytes(12), 400, "x-kvtier-shape"),
    ({"x-kvtier-layout": "7"}, bytes(12), 400, "layout version"),
    ({}, bytes(11), 400, "needs 12"),
    ({}, bytes(13), 400, "needs 12"),
    ({"x-kvtier-checksum": "0123456789abcdef"}, bytes(12), 400, "checksum"),
    ({"x-kvtier-shape": "2048,2048"}, bytes(16), 413, "limit"),
])
def test_bad_puts_get_4xx_naming_the_problem_and_store_nothing(server, headers, body, status, words):
    response = raw_put(server.url, body, **headers)
    assert response.status_code == status, response.text
    assert response.json()["error"] and words in response.json()["detail"]
    assert httpx.get(f"{server.url}/v1/namespaces/bad/keys").json()["keys"] == []


def test_missing_headers_bad_names_and_bad_batches_are_4xx(client, server):
    r = httpx.put(f"{server.url}/v1/namespaces/bad/blocks/k", content=bytes(4))
    assert r.status_code == 400 and "x-kvtier-dtype" in r.json()["detail"]
    for path in ("bad!ns/blocks/k", "bad/blocks/a//b", "bad/blocks/a/%2E%2E", "bad/blocks/" + "k" * 401):
        r = httpx.get(f"{server.url}/v1/namespaces/{path}")
        assert r.status_code == 400 and "must be" in r.json()["detail"], path
    body = b"".join(pack_batch([("k1", Descriptor("int8", (3,)), None)], [bytes([1, 2, 3])]))
    assert httpx.post(f"{server.url}/v1/namespaces/ok/batch/put", content=body).status_code == 201
    for broken in (body[:-1], b"\xff" * 8 + body[8:], b"abc", body[:12], body.replace(b'"int8"', b'"int9"'),
                   body.replace(b'"shape":[3]', b'"shape":[4]'), body.replace(b'"layout":1', b'"layout":2')):
        r = httpx.post(f"{server.url}/v1/namespaces/bad/batch/put", content=broken)
        assert r.status_code == 400 and r.json()["error"] == "bad_request", (broken[:40], r.text)
    with pytest.raises(NotFoundError, match="nope"):
        client.get_many("bad", ["nope"])
    with pytest.raises(ValueError, match="unsupported dtype"):
        client.put("bad", "k", torch.zeros(3, dtype=torch.float64))
    assert client.keys("bad") == []


def test_a_full_store_answers_507_and_stores_nothing(make_server):
    server = make_server("--ssd-bytes", "64K").start()
    with Client(server.url) as c:
        c.put("full", "a", random_tensor(torch.uint8, (40_000,), seed=1))
        with pytest.raises(StorageFullError, match="exceeds the free ssd budget"):
            c.put_many("full", {"b": random_tensor(torch.uint8, (10,), seed=2),
                                "c": random_tensor(torch.uint8, (30_000,), seed=3)})
        assert c.keys("full") == ["a"]
        c.delete("full", "a")
        c.put("full", "c", random_tensor(torch.uint8, (30_000,), seed=3))  # room again once deleted


def test_body_over_the_limit_is_413(server):
    r = httpx.post(f"{server.url}/v1/namespaces/bad/batch/put", content=bytes(17 << 20))
    assert r.status_code == 413 and "limit" in r.json()["detail"]


def test_metrics_count_bytes_hits_and_latency(client, server):
    client.put("metrics", "m", random_tensor(torch.uint8, (1000,), seed=3))
    client.get("metrics", "m")
    with pytest.raises(NotFoundError):
        client.get("metrics", "absent")
    text = client.metrics()
    for name in ('kvtier_tier_bytes{tier="ssd"}', 'kvtier_lookups_total{result="cpu_hit"}',
                 'kvtier_lookups_total{result="miss"}', "kvtier_bytes_in_total", "kvtier_bytes_out_total",
                 'kvtier_request_seconds_bucket{le="0.005",method="GET",route="/v1/namespaces/{namespace}/blocks/{key:path}"}',
                 "kvtier_integrity_errors_total"):
        assert name in text, name
    assert httpx.get(f"{server.url}/docs").status_code == 200
    assert "/v1/namespaces/{namespace}/batch/get" in httpx.get(f"{server.url}/openapi.json").json()["paths"]
