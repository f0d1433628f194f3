"""The ssd tier: persistence across processes, corruption detection, compression."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import lmdb
import pytest
import torch

from tiers.base import IntegrityError
from tiers.codec import Codec
from tiers.layout import BlockLayout
from tiers.quant import quantize
from tiers.ssd import SsdTier

LAYOUT = BlockLayout(num_kv_heads=2, block_tokens=32, head_dim=64)


def kv_like(n: int, seed: int) -> torch.Tensor:
    """Blocks with the magnitude structure of real keys (a few large channels)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *LAYOUT.shape), generator=g)
    x[:, 0, :, :, :4] *= 30
    return x.half()


@pytest.mark.parametrize("compression", ["zstd-split", "zstd", "none"])
def test_blocks_survive_a_new_process(tmp_path, compression):
    path = str(tmp_path / "db")
    x = kv_like(4, seed=1)
    tier = SsdTier(LAYOUT, path, 1 << 26, compression=compression)
    tier.put([10, 11, 12, 13], x)
    tier.put([20], quantize(x[:1]))
    tier.close()
    torch.save(x, tmp_path / "x.pt")
    script = textwrap.dedent(f"""
        import torch
        from tiers.layout import BlockLayout
        from tiers.quant import quantize
        from tiers.ssd import SsdTier
        tier = SsdTier(BlockLayout(2, 32, 64), {path!r}, 1 << 26)
        x = torch.load({str(tmp_path / "x.pt")!r})
        assert tier.num_blocks == 5, tier.num_blocks
        assert torch.equal(tier.get([10, 11, 12, 13]), x)
        got, want = tier.get([20]), quantize(x[:1])
        assert all(torch.equal(a, b) for a, b in zip(got.tensors(), want.tensors()))
        tier.check_integrity()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def flip_byte(path: str, key: bytes, offset: int) -> None:
    env = lmdb.open(path)
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(key))
        value[offset % len(value)] ^= 0x10
        txn.put(key, bytes(value))
    env.close()


@pytest.mark.parametrize("where", ["header", "payload", "last"])
def test_corrupt_value_raises_never_returns_data(tmp_path, where):
    path = str(tmp_path / "db")
    tier = SsdTier(LAYOUT, path, 1 << 26)
    tier.put([1, 2], kv_like(2, seed=2))
    tier.close()
    flip_byte(path, tier.key(1), {"header": 20, "payload": 200, "last": -1}[where])
    tier = SsdTier(LAYOUT, path, 1 << 26)
    with pytest.raises(IntegrityError):
        tier.get([2, 1])
    assert tier.integrity_errors == 1
    assert torch.equal(tier.get([2]), kv_like(2, seed=2)[1:])  # the intact block still reads
    tier.close()


def test_compression_shrinks_values(tmp_path):
    """Which mode wins is measured on real KV in the tiers benchmark; here both must shrink."""
    x = kv_like(16, seed=3)
    sizes = {}
    for compression in ("zstd-split", "zstd"):
        tier = SsdTier(LAYOUT, str(tmp_path / compression), 1 << 26, compression=compression)
        tier.put(list(range(16)), x)
        sizes[compression] = tier.used_bytes
        tier.close()
    assert max(sizes.values()) < 16 * LAYOUT.fp16_bytes


def test_unwritable_path_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="not a writable directory"):
        SsdTier(LAYOUT, str(blocker / "db"), 1 << 20)


def test_writer_batches_concurrent_puts(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    tier = SsdTier(LAYOUT, str(tmp_path / "db"), 1 << 28)
    x = kv_like(32, seed=4)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: tier.put([i], x[i:i + 1]), range(32)))
    assert torch.equal(tier.get(list(range(32))), x)
    tier.check_integrity()
    tier.close()


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
def test_quantized_blocks_are_stored_raw_and_read_back_exactly(tmp_path, fmt):
    """zstd would shrink these (constant keys: one code repeated) but quantized payloads are stored raw; fp16
    ones still compress."""
    x = torch.zeros_like(kv_like(4, seed=4))
    tier = SsdTier(LAYOUT, str(tmp_path / fmt), 1 << 26, compression="zstd")
    raw = Codec("none").encode(LAYOUT, quantize(x[:1], fmt), 0)
    tier.put([0, 1, 2, 3], quantize(x, fmt))
    assert tier.used_bytes == 4 * len(raw)
    got, want = tier.get([0, 1, 2, 3]), quantize(x, fmt)
    assert all(torch.equal(a, b) for a, b in zip(got.tensors(), want.tensors()))
    tier.put([4], x[:1])
    assert tier.used_bytes < 4 * len(raw) + LAYOUT.fp16_bytes
    tier.close()
