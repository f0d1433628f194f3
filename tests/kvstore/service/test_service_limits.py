"""Limits that keep the sidecar answering: requests in flight are capped (open connections are not,
up to a far larger cap of their own), past the cap the answer is a JSON 503 counted in /metrics,
and a prefix lookup is bounded in tokens and parsed off the event loop."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch

from tests.kvstore.service.conftest import (
    ServerProcess, connect, head, metric, random_tensor, read_response, same_bits, wait_until,
)
from tiers.keys import ChunkKeys
from tiers.remote.client import Client

MAX_REQUESTS, MAX_CONNECTIONS, MAX_LOOKUP_TOKENS = 4, 64, 65536
KEYS = ChunkKeys("limits-model", num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8, block_tokens=16)


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("limited") / "data", "--max-requests", str(MAX_REQUESTS),
                         "--max-connections", str(MAX_CONNECTIONS), "--body-timeout", "20",
                         "--max-lookup-tokens", str(MAX_LOOKUP_TOKENS))
    yield proc.start()
    proc.stop()


def round_trip(server, key: str) -> bool:
    value = random_tensor(torch.float16, (3, 5), seed=len(key))
    with Client(server.url) as c:
        c.put("limits", key, value)
        return same_bits(c.get("limits", key), value)


def stalled_puts(server, n: int) -> list:
    """n PUTs whose bodies stop after 3 of 16 bytes: each stays in flight until its socket closes."""
    headers = {"x-kvtier-dtype": "int8", "x-kvtier-shape": "16", "x-kvtier-layout": "1", "Content-Length": "16"}
    socks = [connect(server) for _ in range(n)]
    for i, sock in enumerate(socks):
        sock.sendall(head("PUT", f"/v1/namespaces/limits/blocks/stalled{i}", headers) + b"abc")
    return socks


def test_idle_connections_do_not_count_against_the_request_limit(limited):
    idle = [connect(limited) for _ in range(6 * MAX_REQUESTS)]  # open, nothing sent: held 20 s by --body-timeout
    try:
        time.sleep(0.2)
        assert httpx.get(f"{limited.url}/healthz").json() == {"status": "ok"}
        assert round_trip(limited, "beside-idle")
    finally:
        for sock in idle:
            sock.close()


def test_requests_beyond_the_in_flight_limit_get_a_json_503_counted_in_metrics(limited):
    before = metric(limited, "kvtier_overloaded_requests_total")
    stalled = stalled_puts(limited, MAX_REQUESTS)
    try:
        wait_until(lambda: metric(limited, "kvtier_requests_in_flight") == MAX_REQUESTS)
        refused = [httpx.get(f"{limited.url}/v1/namespaces/limits/blocks/any"),
                   httpx.post(f"{limited.url}/v1/prefix/limits/lookup", json={"block_tokens": 16, "chunk_hashes": []})]
        for r in refused:
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"] == "overloaded" and str(MAX_REQUESTS) in r.json()["detail"]
        assert httpx.get(f"{limited.url}/healthz").status_code == 200  # ops paths are answered regardless
        assert metric(limited, "kvtier_overloaded_requests_total") == before + 2
    finally:
        for sock in stalled:
            sock.close()
    wait_until(lambda: metric(limited, "kvtier_requests_in_flight") == 0)
    assert round_trip(limited, "after-overload")


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_connections_beyond_the_cap_are_closed_unanswered(make_server, http):
    server = make_server("--http", http, "--max-connections", "8", "--body-timeout", "20").start()
    idle = [connect(server) for _ in range(8)]
    try:
        with connect(server) as extra:
            extra.sendall(head("GET", "/healthz", {}))
            try:
                assert extra.recv(100) == b""
            except ConnectionResetError:
                pass
    finally:
        for sock in idle:
            sock.close()
    wait_until(lambda: httpx.get(f"{server.url}/healthz").status_code == 200)


def lookup_body(num_tokens: int) -> bytes:
    """A lookup of num_tokens token ids, written compactly (two bytes per token)."""
    envelope = json.dumps({"block_tokens": KEYS.block_tokens, "model": KEYS.model()}, separators=(",", ":"))
    return envelope[:-1].encode() + b',"token_ids":[' + b"7," * (num_tokens - 1) + b"7]}"


def test_a_lookup_over_the_token_limit_is_refused_before_it_is_parsed(limited):
    server, path, limit = limited, "/v1/prefix/ns/lookup", str(MAX_LOOKUP_TOKENS)
    before = metric(server, "kvtier_lookup_requests_total")
    r = httpx.post(server.url + path, content=lookup_body(MAX_LOOKUP_TOKENS + 1),
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "too_large" and limit in r.json()["detail"], r.text
    with connect(server) as sock:  # declared 32 MiB of token ids: refused on the headers, nothing read
        start = time.monotonic()
        sock.sendall(head("POST", path, {"Content-Type": "application/json", "Content-Length": str(32 << 20)}))
        status, _, body, closed = read_response(sock)
        assert status == 413 and limit in json.loads(body)["detail"] and closed
    with connect(server) as sock:  # streamed without a length: refused once it has named too many tokens
        sock.sendall(head("POST", path, {"Content-Type": "application/json", "Transfer-Encoding": "chunked"}))
        piece = lookup_body(1 << 19)[:-2]  # never finished
        sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        status, _, body, closed = read_response(sock)
        assert status == 413 and limit in json.loads(body)["detail"] and closed
    assert time.monotonic() - start < 10  # neither waited for the body the client never sent
    assert metric(server, "kvtier_lookup_requests_total") == before
    assert httpx.post(server.url + path, content=lookup_body(MAX_LOOKUP_TOKENS),
                      headers={"Content-Type": "application/json"}).json()["num_tokens"] == 0


def test_healthz_answers_promptly_while_a_large_lookup_is_parsed_and_hashed(make_server):
    num_tokens = 1 << 23
    server = make_server("--max-lookup-tokens", str(num_tokens)).start()
    answer = {}

    def look_up() -> None:
        answer["lookup"] = httpx.post(f"{server.url}/v1/prefix/ns/lookup", content=lookup_body(num_tokens),
                                      headers={"Content-Type": "application/json"}, timeout=120)

    thread = threading.Thread(target=look_up)
    thread.start()
    waits = []
    with httpx.Client() as client:
        while thread.is_alive():
            start = time.monotonic()
            assert client.get(f"{server.url}/healthz").status_code == 200
            waits.append(time.monotonic() - start)
            time.sleep(0.02)
    thread.join()
    assert answer["lookup"].json() == {"num_tokens": 0, "num_chunks": 0, "chunk_hashes": []}
    assert len(waits) >= 10  # the lookup took seconds: /healthz was asked all through it
    # Parsed whole, 8M token ids keep the event loop waiting for seconds; a slice at a time, a fraction of one.
    assert max(waits) < 1.0, sorted(waits)[-5:]
