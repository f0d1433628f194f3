"""Acknowledged puts survive restarts and kill -9; corrupt values give errors, never bytes."""

from __future__ import annotations

import os
import threading
import time

import httpx
import lmdb
import pytest
import torch

from tiers.remote.client import Client, CorruptValueError, ServiceError
from tests.kvstore.service.conftest import random_tensor, same_bits


def value_for(i: int) -> torch.Tensor:
    shapes = [(2, 2, 16, 24), (3, 5), (2, 1, 8, 8)]
    dtypes = [torch.float16, torch.int8, torch.bfloat16]
    return random_tensor(dtypes[i % 3], shapes[i % 3], seed=1000 + i)


def test_values_survive_a_clean_restart(make_server):
    server = make_server().start()
    with Client(server.url) as c:
        c.put_many("persist", {f"k{i}": value_for(i) for i in range(12)})
        c.delete("persist", "k3")
        assert same_bits(c.get("persist", "k0"), value_for(0))
        server.stop()
        server.start(same_port=True)
        # The same client: its kept-alive connections died with the old server and are replaced.
        assert c.keys("persist") == sorted(f"k{i}" for i in range(12) if i != 3)
        got = c.get_many("persist", [f"k{i}" for i in range(12) if i != 3])
        assert all(same_bits(g, value_for(i)) for g, i in zip(got, [i for i in range(12) if i != 3]))
        assert c.stats("persist")["blocks"] == 11
        assert c.stats()["tiers"]["ssd"]["blocks"] == 11


def writer(url: str, first: int, acked: list[int], stop: threading.Event, batch: int, failed: list[str]) -> None:
    """Put values in a loop; record a value's index only once its put returned 2xx."""
    with Client(url, timeout=10) as c:
        i = first
        while not stop.is_set():
            try:
                if batch == 1:
                    c.put("crash", f"k{i}", value_for(i))
                else:
                    c.put_many("crash", [(f"k{j}", value_for(j)) for j in range(i, i + batch)])
            except ServiceError as exc:
                failed.append(exc.code)
                return  # the server died under us: this put is not acknowledged
            acked.extend(range(i, i + batch))
            i += batch


def kill_during_writes(server, round_: int) -> list[int]:
    """Start 3 writers (single puts and batches of 7), kill -9 the server mid-write; the acknowledged indices."""
    acked: list[int] = []
    failed: list[str] = []
    stop = threading.Event()
    starts = [round_ * 10_000_000 + offset for offset in (0, 1_000_000, 2_000_000)]
    threads = [threading.Thread(target=writer, args=(server.url, start, acked, stop, batch, failed))
               for start, batch in zip(starts, (1, 1, 7))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while len(acked) < 100 and time.monotonic() < deadline:
        time.sleep(0.05)
    server.kill9()  # mid-write: puts are in flight
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert len(acked) >= 100 and failed, "the kill must land while puts are in flight"
    return acked


# Rounds of kill -9, and extra server flags (e.g. --no-sync); the hand-run fault check in
# BENCHMARKS.md sets KVTIER_KILL_ROUNDS=12 and runs once with KVTIER_KILL_SERVER_ARGS=--no-sync.
KILL_ROUNDS = int(os.environ.get("KVTIER_KILL_ROUNDS", "3"))
KILL_SERVER_ARGS = os.environ.get("KVTIER_KILL_SERVER_ARGS", "").split()


def test_every_acknowledged_put_survives_repeated_kill_9(make_server):
    server = make_server(*KILL_SERVER_ARGS).start()
    acked: list[int] = []
    for round_ in range(KILL_ROUNDS):
        acked += kill_during_writes(server, round_)
        server.start()
        with Client(server.url) as c:
            for start in range(0, len(acked), 200):
                keys = [f"k{i}" for i in acked[start:start + 200]]
                got = c.get_many("crash", keys)
                assert all(same_bits(g, value_for(i)) for g, i in zip(got, acked[start:start + 200]))
            # No torn values: whatever else made it to disk reads back whole too.
            stored = c.keys("crash")
            assert set(f"k{i}" for i in acked) <= set(stored)
            for start in range(0, len(stored), 200):
                got = c.get_many("crash", stored[start:start + 200])
                assert all(same_bits(g, value_for(int(k[1:]))) for g, k in zip(got, stored[start:start + 200]))
            assert httpx.get(f"{server.url}/healthz").json() == {"status": "ok"}
    print(f"{KILL_ROUNDS} kill -9 rounds {KILL_SERVER_ARGS}: {len(acked)} acknowledged puts, 0 lost")


def stored_value(data_dir, key: bytes) -> bytes:
    env = lmdb.open(str(data_dir / "values.lmdb"), subdir=True, readonly=True)
    with env.begin() as txn:
        value = txn.get(key)
    env.close()
    return value


def flip_byte(data_dir, key: bytes, offset: int) -> None:
    env = lmdb.open(str(data_dir / "values.lmdb"), subdir=True)
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(key))
        value[offset % len(value)] ^= 0x04
        txn.put(key, bytes(value))
    env.close()


def test_corrupt_value_is_an_error_and_a_metric_never_data(make_server):
    server = make_server("--compression", "zstd").start()
    with Client(server.url) as c:
        c.put_many("disk", {f"k{i}": value_for(i) for i in range(4)})
        c.put("disk", "big", torch.arange(20000, dtype=torch.int32) % 7)
    server.stop()
    compression_flag = 7  # byte 7 of the header: 0 stored raw, 1 zstd (kvstore/service/values.py)
    assert stored_value(server.data_dir, b"v/disk/k0")[compression_flag] == 0  # random: zstd did not pay
    assert stored_value(server.data_dir, b"v/disk/big")[compression_flag] == 1
    flip_byte(server.data_dir, b"v/disk/k0", -5)  # raw payload
    flip_byte(server.data_dir, b"v/disk/k1", 12)  # header
    flip_byte(server.data_dir, b"v/disk/big", -3)  # compressed payload
    server.start()
    with Client(server.url) as c:
        for key in ("k0", "k1", "big"):
            r = httpx.get(f"{server.url}/v1/namespaces/disk/blocks/{key}")
            assert r.status_code == 500 and r.json()["error"] == "integrity_error", r.text
            assert "checksum" in r.json()["detail"] or "damaged" in r.json()["detail"]
            assert set(r.json()) == {"error", "detail"}  # no bytes of the value
        with pytest.raises(CorruptValueError, match="k0"):
            c.get_many("disk", ["k2", "k0"])
        assert same_bits(c.get("disk", "k2"), value_for(2)) and same_bits(c.get("disk", "k3"), value_for(3))
        assert "kvtier_integrity_errors_total 4.0" in c.metrics()
        assert c.stats()["integrity_errors"] == 4
        c.put("disk", "k0", value_for(0))  # a fresh put replaces the damaged value
        assert same_bits(c.get("disk", "k0"), value_for(0))
