"""The redis tier's connections: opening a server or cluster, sending values as they are, pipelines
of single-key commands (which answers mean Redis is not serving), and reading GET replies straight
into a caller's memory.

redis-py's reply path copies a large value twice (hiredis's read buffer, then a new bytes
object) before the tier copies it into the batch; `get_replies` sends pipelined GETs on the
client's own pooled connections (a cluster: one per master, the keys grouped by slot owner) and
hands over each bulk reply's length, so the caller receives the value where it belongs
(BENCHMARKS.md, "Redis tier", has the numbers).
"""

from __future__ import annotations

import socket
from typing import Callable, Iterator, Sequence

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import Connection, Encoder, PythonRespSerializer
from redis.retry import Retry

FAILURES = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.ClusterError,
            redis.exceptions.RedisClusterException)
_READ_AHEAD = 1 << 16  # bytes buffered for reply headers; a value's bulk goes straight to its memory


class SlotsMoved(Exception):
    """A cluster master answered MOVED or ASK: the slots changed since the client mapped them."""


def about_key_or_memory(answer: Exception) -> bool:
    return isinstance(answer, redis.exceptions.OutOfMemoryError) or str(answer).startswith("WRONGTYPE")


class ReplyReader:
    """RESP replies from one socket: header lines through a small buffer, bulk bytes into the caller's memory."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray(_READ_AHEAD)
        self.view = memoryview(self.buffer)
        self.start = self.end = 0

    def line(self) -> bytes:
        while (stop := self.buffer.find(b"\r\n", self.start, self.end)) < 0:
            self._fill()
        text = bytes(self.view[self.start: stop])
        self.start = stop + 2
        return text

    def read_into(self, dest: memoryview) -> None:
        """Exactly len(dest) bytes of the stream into dest: what is buffered, then recv_into dest itself."""
        got = min(len(dest), self.end - self.start)
        dest[:got] = self.view[self.start: self.start + got]
        self.start += got
        while got < len(dest):
            got += self._recv_into(dest[got:])

    def bulk_length(self) -> int | None | Exception:
        """The next reply's length (a bulk string), None (nil: no such key) or the error it answered."""
        head = self.line()
        kind = head[:1]
        if kind == b"$":
            if not head[1:].lstrip(b"-").isdigit():
                raise ConnectionError(f"expected a bulk length after '$' in a GET reply, got {head[:40]!r}")
            length = int(head[1:])
            return None if length < 0 else length
        if kind == b"_":  # RESP3 nil
            return None
        if kind == b"-":
            text = head[1:].decode(errors="replace")
            if text.startswith(("MOVED ", "ASK ")):
                raise SlotsMoved(text)
            return redis.exceptions.ResponseError(text)
        raise ConnectionError(f"expected a bulk string or an error reply to GET, got {head[:40]!r}")

    def end_bulk(self) -> None:
        rest = self.line()
        if rest:
            raise ConnectionError(f"expected CRLF right after a bulk string's bytes, got {bytes(rest[:40])!r}")

    def _fill(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buffer):
            self.buffer[: self.end - self.start] = self.buffer[self.start: self.end]
            self.start, self.end = 0, self.end - self.start
        self.end += self._recv_into(self.view[self.end:])

    def _recv_into(self, dest: memoryview) -> int:
        try:
            n = self.sock.recv_into(dest)
        except OSError as exc:  # a timeout or a reset
            raise ConnectionError(f"redis tier: reading a reply failed ({type(exc).__name__}: {exc})") from None
        if not n:
            raise ConnectionError("redis tier: redis closed the connection mid-reply")
        return n


class _Stream:
    """The GETs of one master: its rows of the batch, how many are sent and how many read."""

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self.pool, self.rows, self.keys = pool, [], []
        self.conn = pool.get_connection()
        # The pool's socket, connected and authenticated: redis-py has no public way to it. Its own reply
        # parsers take `connection._sock` in on_connect (a parser set with the public set_parser would too);
        # read_response copies each value (what this module avoids); sockets of our own would redo the
        # pool's handshake (AUTH or credential providers, SELECT, HELLO, TLS, unix sockets).
        self.reader = ReplyReader(self.conn._sock)
        self.sent = self.read = 0

    def send_ahead(self, count: int) -> None:
        stop = min(len(self.keys), self.read + count)
        if stop > self.sent:
            commands = b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in self.keys[self.sent: stop])
            self.conn.send_packed_command([commands], check_health=False)
            self.sent = stop

    def close(self) -> None:
        if self.read < self.sent:  # replies left on the wire: the connection cannot be reused
            self.conn.disconnect()
        self.pool.release(self.conn)


def get_replies(client: redis.Redis | RedisCluster, keys: list[bytes], window: int) -> Iterator[tuple[int, int | None | Exception, ReplyReader]]:
    """(index into keys, bulk length / None / error answer, reader) per key, masters in turn;
    the caller reads exactly `length` bytes with reader.read_into before the next. At most two
    windows of GETs are in flight per master (bounds its reply buffer). A dead connection raises
    ConnectionError, MOVED or ASK raises SlotsMoved; connections left mid-reply are dropped."""
    streams: dict[str, _Stream] = {}
    try:
        for index, key in enumerate(keys):
            pool, name = _pool_of(client, key)
            if name not in streams:
                streams[name] = _Stream(pool)
            streams[name].rows.append(index)
            streams[name].keys.append(key)
        while any(s.read < len(s.keys) for s in streams.values()):
            for s in streams.values():
                s.send_ahead(2 * window)
                for _ in range(min(window, len(s.keys) - s.read)):
                    length = s.reader.bulk_length()
                    yield s.rows[s.read], length, s.reader
                    if isinstance(length, int):
                        s.reader.end_bulk()
                    s.read += 1
    except FAILURES as exc:  # connecting or sending
        raise ConnectionError(f"redis tier: GET failed mid-batch ({type(exc).__name__}: {exc})") from None
    finally:
        for s in streams.values():
            s.close()


def pipelined(client: redis.Redis | RedisCluster, url: str, keys: list[bytes], command: Callable,
              values: Sequence | None, chunk: int) -> list:
    """command(pipe, key, value) per key, `chunk` keys per redis-py pipeline; the answers in order. WRONGTYPE
    and OOM answers come back in them (they are about a key or memory); a dead connection or any other error
    answer (CLUSTERDOWN, LOADING, ...) raises ConnectionError: Redis is not serving."""
    values = values if values is not None else [None] * len(keys)
    results: list = []
    for start in range(0, len(keys), chunk):
        pipe = client.pipeline(transaction=False)
        for key, value in zip(keys[start: start + chunk], values[start: start + chunk]):
            command(pipe, key, value)
        try:
            answers = pipe.execute(raise_on_error=False)
        except FAILURES as exc:
            raise ConnectionError(f"redis tier: {url} failed mid-batch ({type(exc).__name__}: {exc})") from None
        refused = [a for a in answers if isinstance(a, Exception) and not about_key_or_memory(a)]
        if refused:
            raise ConnectionError(f"redis tier: {url} is not serving ({type(refused[0]).__name__}: {refused[0]})")
        results.extend(answers)
    return results


def pipelined_gets(client: redis.Redis | RedisCluster, url: str, keys: list[bytes], chunk: int) -> Iterator:
    """get_replies's answers through redis-py's pipelines (which follow a cluster's MOVED and ASK),
    `chunk` values at a time."""
    for start in range(0, len(keys), chunk):
        values = pipelined(client, url, keys[start: start + chunk], lambda pipe, k, _: pipe.get(k), None, chunk)
        for row, value in enumerate(values, start):
            yield row, value if value is None or isinstance(value, Exception) else len(value), _Held(value)


class _Held:
    """A value redis-py already read, handed over like a ReplyReader hands over a bulk reply."""

    def __init__(self, value: bytes) -> None:
        self.value = value

    def read_into(self, dest: memoryview) -> None:
        dest[:] = self.value


def _pool_of(client: redis.Redis | RedisCluster, key: bytes) -> tuple[redis.ConnectionPool, str]:
    if isinstance(client, RedisCluster):
        node = client.get_node_from_key(key)
        return client.get_redis_connection(node).connection_pool, node.name
    return client.connection_pool, ""


class _SendValuesAsIs(Connection):
    """A TCP connection whose commands are packed by redis-py's Python serializer, which sends a
    large value (a memoryview into the put buffer) as it is; hiredis's packer, the default when
    hiredis is installed, copies every value twice. Replies are still parsed by hiredis."""

    def __init__(self, **kwargs) -> None:
        super().__init__(command_packer=PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode), **kwargs)


def connect(url: str, timeout: float) -> tuple[redis.Redis | RedisCluster, bool]:
    """A client for `url`: a cluster client if the node says it is part of a cluster."""
    options = dict(socket_timeout=timeout, socket_connect_timeout=min(timeout, 5.0),
                   socket_read_size=1 << 20)  # large values: fewer recv calls than the 32 KiB default
    if url.startswith("redis://"):  # TLS and unix sockets keep their own connection classes
        options["connection_class"] = _SendValuesAsIs
    try:
        # No silent retries: a pipeline replayed after a restart would meet its own SET NX keys;
        # a failure surfaces as ConnectionError and the caller decides.
        client = redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **options)
        cluster = client.info("cluster").get("cluster_enabled") == 1
    except (redis.RedisError, ValueError) as exc:
        raise ValueError(f"redis tier: no Redis answers at {url!r} ({type(exc).__name__}: {exc})") from None
    if not cluster:
        return client, False
    client.close()
    try:
        return RedisCluster.from_url(url, **options), True
    except redis.RedisError as exc:
        raise ValueError(f"redis tier: cannot open the cluster at {url!r} ({exc})") from None
