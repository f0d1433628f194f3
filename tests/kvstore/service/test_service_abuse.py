"""Hostile and broken clients: the token comes before any body, bodies are bounded and timed,
nesting never crashes a parser, disconnects are not server errors, bad tokens never start."""

from __future__ import annotations

import json
import re
import struct
import time

import httpx
import pytest

from kvstore.service.serve import main
from kvstore.service.settings import ServiceSettings
from tests.kvstore.service.conftest import TOKEN, connect, head, read_response

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize("route, content_type", [("batch/get", "application/json"),
                                                 ("batch/put", "application/octet-stream")])
def test_token_is_checked_before_any_body_byte_is_read(guarded, route, content_type):
    # 900 KB declared (under the 1 MiB limit), none sent: only a check on the headers can answer.
    with connect(guarded) as sock:
        sock.sendall(head("POST", f"/v1/namespaces/ns/{route}",
                          {"Content-Type": content_type, "Content-Length": str(900_000)}))
        status, headers, body, closed = read_response(sock)
    assert status == 401 and json.loads(body)["error"] == "unauthorized"
    assert headers["www-authenticate"] == "Bearer" and closed  # the unread body is never read


def test_a_declared_body_over_the_limit_is_413_before_it_is_sent(guarded):
    with connect(guarded) as sock:
        sock.sendall(head("POST", "/v1/namespaces/ns/batch/get",
                          {**AUTH, "Content-Type": "application/json", "Content-Length": str(200 << 20)}))
        status, _, body, closed = read_response(sock)
    assert status == 413 and "limit" in json.loads(body)["detail"] and closed


@pytest.mark.parametrize("route", ["batch/get", "batch/delete", "batch/put"])
def test_a_streamed_body_over_the_limit_is_413(guarded, route):
    # Valid JSON of 2 MiB without a Content-Length: only counting while it streams can refuse it.
    keys = json.dumps({"keys": [f"k{i:05d}" + "x" * 390 for i in range(5200)]}).encode()
    pieces = (keys[i:i + 65536] for i in range(0, len(keys), 65536))
    r = httpx.post(f"{guarded.url}/v1/namespaces/ns/{route}", content=pieces,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "too_large", r.text


def test_a_stalled_body_gets_408_and_the_connection_closes(guarded):
    headers = {**AUTH, "x-kvtier-dtype": "int8", "x-kvtier-shape": "16", "x-kvtier-layout": "1",
               "Content-Length": "16"}
    with connect(guarded) as sock:
        sock.sendall(head("PUT", "/v1/namespaces/ns/blocks/slow", headers) + b"abc")  # 3 of 16 bytes
        start = time.monotonic()
        status, _, body, closed = read_response(sock)
    assert status == 408 and json.loads(body)["error"] == "body_timeout" and closed
    assert time.monotonic() - start < 4  # --body-timeout 1
    assert httpx.get(f"{guarded.url}/v1/namespaces/ns/keys", headers=AUTH).json()["keys"] == []


@pytest.mark.parametrize("sent", [b"", b"GET /healthz HTTP/1.1\r\nHost: x"])
def test_a_connection_without_a_whole_request_head_is_closed(guarded, sent):
    with connect(guarded) as sock:
        sock.sendall(sent)
        start = time.monotonic()
        assert sock.recv(100) == b""  # closed, no request was read; the socket timeout is 5 s
    assert time.monotonic() - start < 4  # --body-timeout 1 bounds the head too


def test_a_kept_alive_connection_still_works_and_its_next_head_is_timed(guarded):
    with connect(guarded) as sock:
        for _ in range(2):
            sock.sendall(head("GET", "/healthz", {}))
            status, _, body, _ = read_response(sock, then_closed=False)
            assert status == 200 and body == b'{"status":"ok"}'
        sock.sendall(b"GET /heal")
        assert sock.recv(100) == b""


def test_deeply_nested_json_is_a_400_never_a_500(guarded):
    nested = b"[" * 50_000 + b"]" * 50_000
    body = struct.pack("<Q", len(nested)) + nested
    r = httpx.post(f"{guarded.url}/v1/namespaces/ns/batch/put", content=body, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"] == "bad_request" and "nested" in r.json()["detail"], r.text
    r = httpx.post(f"{guarded.url}/v1/namespaces/ns/batch/get", headers={**AUTH, "Content-Type": "application/json"},
                   content=b'{"keys": ' + nested + b"}")
    assert r.status_code == 400 and set(r.json()) == {"error", "detail"}, r.text


def responses(server, route: str) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    pattern = rf'kvtier_responses_total\{{method="(\w+)",route="{re.escape(route)}",status="(\w+)"\}} (\S+)'
    return {f"{m} {s}": float(n) for m, s, n in re.findall(pattern, text)}


def test_client_disconnects_are_counted_apart_from_server_errors(guarded):
    route = "/v1/namespaces/{namespace}/blocks/{key:path}"
    before = responses(guarded, route)
    headers = {**AUTH, "x-kvtier-dtype": "int8", "x-kvtier-shape": "1000", "x-kvtier-layout": "1",
               "Content-Length": "1000"}
    for _ in range(3):
        with connect(guarded) as sock:
            sock.sendall(head("PUT", "/v1/namespaces/ns/blocks/gone", headers) + bytes(10))
        # closed mid-body
    deadline = time.monotonic() + 5
    while responses(guarded, route).get("PUT disconnect", 0) < before.get("PUT disconnect", 0) + 3:
        assert time.monotonic() < deadline, responses(guarded, route)
        time.sleep(0.05)
    after = responses(guarded, route)
    assert not any(k.endswith(" 500") for k in after), after


@pytest.mark.parametrize("token", ["", " ", "\t ", "two words", "quote\"d"])
def test_empty_whitespace_or_unsendable_tokens_are_refused(tmp_path, capsys, monkeypatch, token):
    monkeypatch.delenv("KVTIER_TOKEN", raising=False)
    assert main(["--token", token, "--data-dir", str(tmp_path / "d")]) == 2
    assert "token" in capsys.readouterr().err
    monkeypatch.setenv("KVTIER_TOKEN", token)  # an exported but empty secret is a mistake too
    assert main(["--host", "0.0.0.0", "--data-dir", str(tmp_path / "d")]) == 2
    assert "token must" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()  # refused before touching anything
    with pytest.raises(ValueError, match="token must"):
        ServiceSettings(data_dir=str(tmp_path), token=token)


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_each_http_parser_closes_a_connection_whose_head_never_completes(make_server, http):
    server = make_server("--http", http, "--body-timeout", "1").start()
    for sent in (b"", b"GET /healthz HTTP/1.1\r\nHost: x"):
        with connect(server) as sock:
            sock.sendall(sent)
            start = time.monotonic()
            assert sock.recv(100) == b""
        assert time.monotonic() - start < 4
    with connect(server) as sock:  # a whole head is answered, and the connection kept alive
        sock.sendall(head("GET", "/healthz", {}))
        assert read_response(sock, then_closed=False)[0] == 200
