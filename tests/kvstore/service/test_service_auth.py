"""Tokens and binds: a token-protected server answers 401 to anyone without the token."""

from __future__ import annotations

import httpx
import pytest
import torch

from tiers.remote.client import AuthError, Client
from kvstore.service.serve import is_loopback, main, parse_bytes
from tests.kvstore.service.conftest import random_tensor, same_bits


def test_requests_without_the_right_token_get_401(make_server):
    server = make_server(token="s3cret-token").start()
    url = f"{server.url}/v1/namespaces/ns/blocks/k"
    headers = {"x-kvtier-dtype": "int8", "x-kvtier-shape": "3", "x-kvtier-layout": "1"}
    for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic czNjcmV0LXRva2Vu"}):
        r = httpx.put(url, content=b"abc", headers={**headers, **auth})
        assert r.status_code == 401 and r.json()["error"] == "unauthorized", auth
        assert r.headers["www-authenticate"] == "Bearer"
    for path in ("/v1/stats", "/v1/namespaces/ns/keys", "/metrics"):
        assert httpx.get(server.url + path).status_code == 401, path
    assert httpx.get(server.url + "/healthz").status_code == 200
    with Client(server.url) as anonymous, pytest.raises(AuthError, match="token"):
        anonymous.keys("ns")
    with Client(server.url, token="s3cret-token") as c:
        t = random_tensor(torch.float16, (4, 5), seed=4)
        c.put("ns", "k", t)
        assert same_bits(c.get("ns", "k"), t)
        assert "kvtier_bytes_in_total" in c.metrics()
    with Client(server.url, token="wrong") as c, pytest.raises(AuthError):
        c.get("ns", "k")


def test_non_loopback_bind_refuses_to_start_without_a_token(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVTIER_TOKEN", raising=False)
    assert main(["--host", "0.0.0.0", "--data-dir", str(tmp_path / "d")]) == 2
    assert "token" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()  # refused before touching anything
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.com")


def test_byte_sizes_parse():
    assert parse_bytes("4096") == 4096 and parse_bytes("64M") == 64 << 20 and parse_bytes("1.5GiB") == 3 << 29
    with pytest.raises(Exception, match="byte count"):
        parse_bytes("lots")
