"""The sidecar client against a real `kvtier serve` behind a proxy that closes connections without
answering: an unanswered PUT or DELETE (idempotent) is sent once more and lands; an error answer,
and a POST, are never sent again."""

from __future__ import annotations

import socket
import threading
from typing import BinaryIO

import pytest
import torch

from tests.kvstore.service.conftest import ServerProcess, random_tensor, same_bits
from tiers.remote.client import BadRequestError, Client, NotFoundError, UnreachableError


def _read_message(stream: BinaryIO) -> bytes | None:
    """One HTTP/1.1 message (head and Content-Length body) as it came; None at a clean end of stream."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        line = stream.readline()
        if not line:
            assert not head, "stream ended inside a message head"
            return None
        head += line
    fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
    fields = {name.strip().lower(): value.strip() for name, value in fields.items()}
    assert b"transfer-encoding" not in fields, "this proxy relays Content-Length bodies only"
    return head + stream.read(int(fields.get(b"content-length", b"0")))


class DroppingProxy:
    """A loopback HTTP/1.1 proxy that keeps client connections alive and logs every request line. A
    request whose number (0-based, in arrival order) is in `drop` is read whole and its connection
    closed with no answer: what a client meets when a server closes a kept-alive connection as a
    request goes out. Every other request goes to the server on a connection of its own."""

    def __init__(self, upstream_port: int, drop: set[int]) -> None:
        self.upstream_port, self.drop = upstream_port, drop
        self.requests: list[str] = []
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def methods(self) -> list[str]:
        with self.lock:
            return [line.split()[0] for line in self.requests]

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as incoming:
            while (request := _read_message(incoming)) is not None:
                with self.lock:
                    number = len(self.requests)
                    self.requests.append(request.split(b"\r\n", 1)[0].decode())
                if number in self.drop:
                    return
                with socket.create_connection(("127.0.0.1", self.upstream_port)) as upstream:
                    upstream.sendall(request)
                    with upstream.makefile("rb") as answers:
                        conn.sendall(_read_message(answers))


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("sidecar") / "data", "--max-value-bytes", "4K")
    yield proc.start()
    proc.stop()


def test_an_unanswered_put_or_delete_is_sent_once_more(sidecar):
    a, b = random_tensor(torch.float16, (4, 8), seed=1), random_tensor(torch.int32, (3, 5), seed=2)
    proxy = DroppingProxy(sidecar.port, drop={1, 3})  # the second request of each kept-alive connection
    with Client(proxy.url) as client:
        client.put("retry", "a", a)
        client.put("retry", "b", b)  # dropped once, then stored
        client.delete("retry", "a")  # dropped once, then deleted
    proxy.close()
    assert proxy.methods() == ["PUT", "PUT", "PUT", "DELETE", "DELETE"]
    with Client(sidecar.url) as direct:
        assert direct.keys("retry") == ["b"]
        assert same_bits(direct.get("retry", "b"), b)
        direct.drop_namespace("retry")


def test_error_answers_and_posts_are_not_sent_again(sidecar):
    too_large = random_tensor(torch.float32, (2048,), seed=3)  # 8 KiB: over the 4 KiB value limit
    proxy = DroppingProxy(sidecar.port, drop={2})
    with Client(proxy.url) as client:
        with pytest.raises(BadRequestError):
            client.put("once", "big", too_large)  # 413
        with pytest.raises(NotFoundError):
            client.delete("once", "absent")  # 404
        with pytest.raises(UnreachableError):
            client.put_many("once", {"c": random_tensor(torch.int8, (16,), seed=4)})  # a POST: dropped, not resent
    proxy.close()
    assert proxy.methods() == ["PUT", "DELETE", "POST"]
    with Client(sidecar.url) as direct:
        assert direct.keys("once") == []


def test_a_service_that_never_answers_gives_up_after_one_more_try(sidecar):
    proxy = DroppingProxy(sidecar.port, drop=set(range(100)))
    with Client(proxy.url) as client, pytest.raises(UnreachableError):
        client.put("gone", "a", random_tensor(torch.float16, (4,), seed=5))
    proxy.close()
    assert proxy.methods() == ["PUT", "PUT"]
