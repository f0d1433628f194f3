"""Real `python -m kvstore.service` processes on free loopback ports, for the service tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

REPO = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One sidecar process; start/stop/kill it and start it again on the same data dir."""

    def __init__(self, data_dir: Path, *args: str, token: str | None = None) -> None:
        self.data_dir, self.args, self.token = data_dir, list(args), token
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.log = data_dir.parent / f"{data_dir.name}-server.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0, same_port: bool = False) -> ServerProcess:
        if not (same_port and self.port):
            self.port = free_port()
        cmd = [sys.executable, "-m", "kvstore.service", "--data-dir", str(self.data_dir), "--port", str(self.port),
               *self.args, *(["--token", self.token] if self.token else [])]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError(f"server did not answer within {timeout}s: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> ServerProcess:
    """A shared server with small limits, so limit tests stay cheap."""
    proc = ServerProcess(tmp_path_factory.mktemp("shared") / "data", "--max-value-bytes", "4M",
                         "--max-body-bytes", "16M", "--cpu-bytes", "8M")
    yield proc.start()
    proc.stop()


TOKEN = "s3cret-token"


@pytest.fixture(scope="session")
def guarded(tmp_path_factory) -> ServerProcess:
    """A token server with small limits: 1 MiB bodies, 1 s body timeout."""
    proc = ServerProcess(tmp_path_factory.mktemp("guarded") / "data", "--max-body-bytes", "1M", "--body-timeout", "1",
                         token=TOKEN)
    yield proc.start()
    proc.stop()


@pytest.fixture
def make_server(tmp_path):
    """Factory of private servers; every one is stopped at teardown."""
    made: list[ServerProcess] = []

    def make(*args: str, token: str | None = None, data_dir: Path | None = None) -> ServerProcess:
        proc = ServerProcess(data_dir or tmp_path / f"data{len(made)}", *args, token=token)
        made.append(proc)
        return proc

    yield make
    for proc in made:
        proc.stop()


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Irregular, never-zero values of any supported dtype."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, shape, generator=g, dtype=torch.int64).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_response(sock: socket.socket, then_closed: bool = True) -> tuple[int, dict, bytes, bool]:
    """(status, headers, body, whether the server then closed the connection); socket timeouts fail the test."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    top, _, body = data.partition(b"\r\n\r\n")
    status = int(top.split(b" ")[1])
    pairs = (line.decode().split(": ", 1) for line in top.split(b"\r\n")[1:])
    headers = {name.lower(): value for name, value in pairs}
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    try:
        closed = then_closed and sock.recv(1) == b""
    except socket.timeout:
        closed = False
    except ConnectionResetError:  # closed with bytes the server never read
        closed = True
    return status, headers, body, closed


def metric(server, name: str, headers: dict[str, str] | None = None) -> float:
    """The sum of a metric's samples over all its labels, scraped from /metrics."""
    text = httpx.get(f"{server.url}/metrics", headers=headers).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
