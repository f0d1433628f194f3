"""Real redis-server processes on free loopback ports, for the redis tier's tests and benchmark.

    RedisServer(directory, "--maxmemory", "2mb")   one instance; its AOF/RDB files live in
                                                   `directory`, so restart() reads them back
    RedisCluster(directory)                        three masters joined by
                                                   `redis-cli --cluster create` (no replicas)

Both bind 127.0.0.1 only and write no snapshots unless asked (`--save ""` comes first, so a
later "--save", "60 1" wins).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time

import redis


def missing_binaries() -> str | None:
    """Why local servers cannot start here (None: they can)."""
    lacking = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    return f"{' and '.join(lacking)} not installed (Debian: apt-get install -y redis-server)" if lacking else None


def free_port(bus: bool = False) -> int:
    """A loopback port nobody listens on; with bus=True, port + 10000 is free too (cluster bus)."""
    for _ in range(200):
        port = random.randint(20000, 45000)
        if all(_can_bind(p) for p in ((port, port + 10000) if bus else (port,))):
            return port
    raise RuntimeError("no free loopback port found")


def _can_bind(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class RedisServer:
    def __init__(self, directory: str, *config: str, port: int | None = None, bus: bool = False) -> None:
        self.directory = os.path.abspath(directory)  # redis-server chdirs into --dir before opening the log
        self.config = config
        self.port = port or free_port(bus)
        self.process: subprocess.Popen | None = None
        os.makedirs(directory, exist_ok=True)
        for attempt in range(3):  # another process may take a free port before the server binds it
            try:
                self.start()
                return
            except RuntimeError as exc:
                if port is not None or attempt == 2 or "already in use" not in str(exc):
                    raise
                self.port = free_port(bus)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.directory,
                "--save", "", "--appendonly", "no", "--daemonize", "no",
                "--logfile", os.path.join(self.directory, "redis.log"), *self.config]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: "
                                   f"{self.process.stderr.read().decode()[-2000:]} {self.log()[-2000:]}")
            try:
                with redis.Redis(port=self.port, socket_timeout=1) as client:
                    if client.ping():
                        return
            except (redis.ConnectionError, redis.BusyLoadingError, redis.TimeoutError):
                time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout} s")

    def log(self) -> str:
        try:
            with open(os.path.join(self.directory, "redis.log")) as f:
                return f.read()
        except OSError:
            return ""

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=30)

    def kill(self) -> None:
        """SIGKILL: no shutdown save, no flush beyond what the server already did."""
        self._end(signal.SIGKILL)

    def stop(self) -> None:
        self._end(signal.SIGTERM)

    def restart(self) -> None:
        self.stop()
        self.start()

    def _end(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=30)
        if self.process is not None and self.process.stderr:
            self.process.stderr.close()
        self.process = None


class RedisCluster:
    """Three masters on loopback, every slot assigned, cluster_state:ok before this returns."""

    def __init__(self, directory: str, *config: str, masters: int = 3) -> None:
        self.nodes: list[RedisServer] = []
        try:
            for n in range(masters):
                self.nodes.append(RedisServer(os.path.join(directory, f"node{n}"), "--cluster-enabled", "yes",
                                              "--cluster-config-file", "nodes.conf",
                                              "--cluster-node-timeout", "5000", *config, bus=True))
            addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
            out = subprocess.run(["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "0",
                                  "--cluster-yes"], capture_output=True, text=True, timeout=60)
            if out.returncode:
                raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout[-2000:]} {out.stderr[-2000:]}")
            self._wait_ok()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def _wait_ok(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = []
            for node in self.nodes:
                with node.client() as c:
                    states.append(c.cluster("info").get("cluster_state") == "ok")
            if all(states):
                return
            time.sleep(0.05)
        raise RuntimeError(f"cluster not ok within {timeout} s")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
