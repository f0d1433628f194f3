"""A damaged LMDB file: the store still opens (degraded when its structure is hit), never serves
a damaged or renamed value, reports the damage, and `kvtier verify` finds it and copies out the rest."""

from __future__ import annotations

import random
import shutil
import struct

import httpx
import lmdb
import pytest
import torch
import xxhash

from bench_longctx.cli import main as kvtier
from kvstore.service.lmdbfile import check_file
from kvstore.service.metrics import ServiceMetrics
from kvstore.service.storage import NotFound, ServiceStorage
from tiers.base import IntegrityError
from tiers.remote.client import Client
from tiers.remote.wire import Descriptor
from tests.kvstore.service.conftest import random_tensor

PAGE = 4096
SIZES = [24, 200, 900, 3000, 9000]  # inline values and overflow values of one and several pages


def verify(argv: list[str]) -> int:
    return kvtier(["verify", *argv])


def payload(i: int) -> bytes:
    return random_tensor(torch.uint8, (SIZES[i % len(SIZES)],), seed=i).numpy().tobytes()


def make_store(data_dir, count: int = 160) -> dict[str, bytes]:
    """A store written through the service's own put path in several commits; 5 values deleted in the last."""
    storage = ServiceStorage(str(data_dir), 0, 1 << 30, ServiceMetrics())
    values = {f"k{i:04d}": payload(i) for i in range(count)}
    names = list(values)
    for start in range(0, count, 40):
        storage.put("ns", [(k, Descriptor("uint8", (len(values[k]),)), values[k], None) for k in names[start:start + 40]])
    storage.delete("ns", names[5:10])
    storage.close()
    return {k: v for k, v in values.items() if k not in names[5:10]}


def page_kinds(data: bytes) -> dict[int, list[int]]:
    """page flags -> page numbers (0x01 branch, 0x02 leaf, 0x04 overflow head, 0x08 meta)."""
    kinds: dict[int, list[int]] = {}
    for pgno in range(len(data) // PAGE):
        kinds.setdefault(struct.unpack_from("<H", data, pgno * PAGE + 10)[0], []).append(pgno)
    return kinds


def flip_offsets(data: bytes) -> dict[str, int]:
    """Named offsets in live pages (free pages hold stale copies of every kind)."""
    txnids = [struct.unpack_from("<Q", data, meta * PAGE + 144)[0] for meta in (0, 1)]
    new, old = (0, 1) if txnids[0] > txnids[1] else (1, 0)
    branch = struct.unpack_from("<Q", data, new * PAGE + 128)[0]  # the root: a branch page at 160 values
    assert struct.unpack_from("<H", data, branch * PAGE + 10)[0] == 0x01
    last = (struct.unpack_from("<H", data, branch * PAGE + 12)[0] - 16) // 2 - 1
    leaf = struct.unpack_from("<HHH", data, branch * PAGE + struct.unpack_from("<H", data, branch * PAGE + 16 + 2 * last)[0])
    leaf = leaf[0] | leaf[1] << 16 | leaf[2] << 32  # the root's last child: the last commit did not rewrite it
    first_node = struct.unpack_from("<H", data, leaf * PAGE + 16)[0]  # offset of the leaf's first node
    nodes = [struct.unpack_from("<H", data, leaf * PAGE + 16 + 2 * i)[0] for i in range((
        struct.unpack_from("<H", data, leaf * PAGE + 12)[0] - 16) // 2)]
    bigdata = [o for o in nodes if struct.unpack_from("<H", data, leaf * PAGE + o + 4)[0] == 1]
    ksize = struct.unpack_from("<H", data, leaf * PAGE + bigdata[0] + 6)[0]
    overflow = struct.unpack_from("<Q", data, leaf * PAGE + bigdata[0] + 8 + ksize)[0]
    new, old = new * PAGE, old * PAGE  # meta fields: 10 flags, 16 magic, 120 entries, 128 main root, 144 txnid
    return {
        "meta new magic": new + 16, "meta new flags": new + 10, "meta new txnid": new + 144,
        "meta new root": new + 128, "meta new entries": new + 120, "meta old magic": old + 16,
        "meta old txnid": old + 144, "old meta root": old + 128,  # rewritten by the next commit: may stay healthy
        "branch header": branch * PAGE + 11, "branch child pgno": branch * PAGE + 16 + 2 + 4,
        "branch node ptr": branch * PAGE + 18, "leaf header": leaf * PAGE + 12, "leaf node ptr": leaf * PAGE + 17,
        "leaf node size": leaf * PAGE + first_node, "leaf node flags": leaf * PAGE + first_node + 4,
        "leaf key first byte": leaf * PAGE + first_node + 8, "leaf key last byte": leaf * PAGE + first_node + 8 + 8,
        "overflow header": overflow * PAGE + 2, "overflow pages count": overflow * PAGE + 12,
        "overflow payload": overflow * PAGE + 3000, "last page": len(data) - 100,
    }


def flipped_copy(source, target, offset: int, bit: int = 0x10):
    shutil.copytree(source, target)
    path = target / "values.lmdb" / "data.mdb"
    data = bytearray(path.read_bytes())
    data[offset] ^= bit
    path.write_bytes(bytes(data))
    (target / "values.lmdb" / "lock.mdb").unlink(missing_ok=True)


def test_any_single_flipped_byte_opens_and_serves_no_damaged_value(tmp_path):
    values = make_store(tmp_path / "good")
    written = {f"k{i:04d}": payload(i) for i in range(160)}  # a damaged newest meta falls back one commit
    data = (tmp_path / "good" / "values.lmdb" / "data.mdb").read_bytes()
    degraded = {}
    for name, offset in flip_offsets(data).items():
        for bit in (0x01, 0x10, 0x80):
            copy = tmp_path / f"{name.replace(' ', '-')}-{bit}"
            flipped_copy(tmp_path / "good", copy, offset, bit)
            storage = ServiceStorage(str(copy), 1 << 20, 1 << 30, ServiceMetrics())  # must not raise
            served = 0
            for key in storage.keys("ns", limit=10_000)[0] + list(values):
                try:
                    (value,) = storage.get("ns", [key])
                except (IntegrityError, NotFound):
                    continue
                assert bytes(value.payload) == written[key], f"{name}: damaged value served for {key}"
                served += 1
            degraded[(name, bit)] = storage.damage.read_only
            assert storage.health()["status"] == ("degraded" if storage.damage.read_only else "ok") or \
                storage.integrity_errors
            assert served >= len(values) - 45, f"{name}: only {served} of {len(values)} intact values served"
            storage.close()
    structural = [n for n in flip_offsets(data) if n.split()[0] in ("meta", "branch", "leaf", "overflow")
                  and n not in ("leaf node size", "leaf key last byte", "overflow payload")]  # caught per value
    assert all(degraded[(n, b)] for n in structural for b in (0x01, 0x10, 0x80)), \
        [(n, b) for n in structural for b in (0x01, 0x10, 0x80) if not degraded[(n, b)]]
    assert not any(degraded[("overflow payload", b)] for b in (0x01, 0x10, 0x80))  # caught by the value's checksum


@pytest.mark.parametrize("seed", range(3))
def test_a_healthy_file_is_never_called_damaged(tmp_path, seed):
    """Random puts, overwrites (bigger and smaller, in one txn too) and deletes, with readers pinning old
    snapshots so the free list grows past txnid 255 (its keys are little-endian integers, not bytes)."""
    rng = random.Random(seed)
    env = lmdb.open(str(tmp_path / "env"), map_size=1 << 30, sync=False)
    keys, readers = set(), []
    for txn_id in range(320):
        with env.begin(write=True) as txn:
            for _ in range(rng.randint(1, 30)):
                key = b"v/ns%d/k%04d" % (rng.randint(0, 2), rng.randint(0, 1500))
                if rng.random() < 0.7:
                    txn.put(key, rng.randbytes(rng.choice([16, 600, 2100, 5000, 13000])))
                    keys.add(key)
                elif txn.delete(key):
                    keys.discard(key)
        if txn_id in (230, 250):
            readers.append(env.begin())
            readers[-1].get(b"v")
    for reader in readers:
        reader.abort()
    env.close()
    report = check_file(str(tmp_path / "env"))
    assert report.problems == [] and set(report.entries) == keys


def test_a_renamed_value_is_an_integrity_error_not_another_keys_data(tmp_path):
    values = make_store(tmp_path / "good", count=40)
    env = lmdb.open(str(tmp_path / "good" / "values.lmdb"))
    with env.begin(write=True) as txn:  # what a flipped key byte does, with the B-tree order kept
        stored = txn.get(b"v/ns/k0011")
        txn.delete(b"v/ns/k0011")
        txn.put(b"v/ns/k0010", stored)
    env.close()
    storage = ServiceStorage(str(tmp_path / "good"), 1 << 20, 1 << 30, ServiceMetrics())
    with pytest.raises(IntegrityError, match="written under key b'v/ns/k0011'"):
        storage.get("ns", ["k0010"])
    assert bytes(storage.get("ns", ["k0012"])[0].payload) == values["k0012"]
    assert storage.health()["status"] == "degraded" and storage.health()["integrity_errors"] == 1
    storage.close()


def test_values_written_in_format_1_are_still_read(tmp_path):
    body = payload(3)
    head = struct.pack("<4sHBBB3xQQQ", b"KVTS", 1, 4, 0, 1, len(body), len(body), xxhash.xxh3_64_intdigest(body))
    head += struct.pack("<Q", len(body))
    (tmp_path / "values.lmdb").mkdir()
    env = lmdb.open(str(tmp_path / "values.lmdb"))
    with env.begin(write=True) as txn:
        txn.put(b"v/old/k", head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + body)
    env.close()
    storage = ServiceStorage(str(tmp_path), 1 << 20, 1 << 30, ServiceMetrics())
    (value,) = storage.get("old", ["k"])
    assert bytes(value.payload) == body and value.desc == Descriptor("uint8", (len(body),))
    storage.close()


def test_a_damaged_sidecar_starts_read_only_and_verify_copies_the_rest_out(tmp_path, make_server, capsys):
    values = make_store(tmp_path / "good")
    data = (tmp_path / "good" / "values.lmdb" / "data.mdb").read_bytes()
    flipped_copy(tmp_path / "good", tmp_path / "bad", flip_offsets(data)["leaf node ptr"], 0x80)
    server = make_server(data_dir=tmp_path / "bad").start()
    health = httpx.get(f"{server.url}/healthz").json()
    assert health["status"] == "degraded" and health["mode"] == "read-only" and health["damage"]["problems"] >= 1
    assert "kvtier verify" in health["damage"]["repair"]
    with Client(server.url) as c:
        served = {k: c.get("ns", k) for k in c.keys("ns")}
        assert 0 < len(served) < len(values)  # the node whose offset was damaged is not served
        assert all(t.numpy().tobytes() == values[k] for k, t in served.items())
        assert "kvtier_degraded 1.0" in c.metrics()
        r = httpx.put(f"{server.url}/v1/namespaces/ns/blocks/new", content=b"abc",
                      headers={"x-kvtier-dtype": "uint8", "x-kvtier-shape": "3", "x-kvtier-layout": "1"})
        assert r.status_code == 503 and r.json()["error"] == "degraded"
    server.stop()
    assert verify(["--data-dir", str(tmp_path / "bad")]) == 1
    assert "DAMAGED" in capsys.readouterr().out
    assert verify(["--data-dir", str(tmp_path / "bad"), "--copy-to", str(tmp_path / "fixed")]) == 1
    assert f"copied {len(served)} intact values" in capsys.readouterr().out
    assert verify(["--data-dir", str(tmp_path / "fixed")]) == 0 and verify(["--data-dir", str(tmp_path / "good")]) == 0
    assert verify(["--data-dir", str(tmp_path / "bad"), "--copy-to", str(tmp_path / "fixed")]) == 2  # never over a store
    fixed = make_server(data_dir=tmp_path / "fixed").start()
    assert httpx.get(f"{fixed.url}/healthz").json() == {"status": "ok"}
    with Client(fixed.url) as c:
        assert sorted(c.keys("ns")) == sorted(served)
        c.put("ns", "new", torch.arange(3, dtype=torch.uint8))  # writable again
