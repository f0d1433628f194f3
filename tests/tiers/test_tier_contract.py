"""The contract every tier keeps: round-trip, delete frees, capacity enforced; each block format (fp16, int8,
fp8, int4) comes back as its bytes from a tier that holds that format, as its values from any other."""

from __future__ import annotations

import pytest
import torch

from tiers.codec import HEADER_BYTES
from tiers.cpu import CpuTier
from tiers.hot import HotTier
from tiers.layout import BlockLayout, QuantBlocks
from tiers.quant import dequantize, error_bound, quantize
from tiers.redis import RedisTier
from tiers.ssd import SsdTier
from tiers.warm import WarmTier

LAYOUT = BlockLayout(num_kv_heads=3, block_tokens=16, head_dim=64)
CAPACITY_BLOCKS = 6
FORMATS = ["int8", "fp8", "int4"]


def make_tier(name: str, tmp_path, request):
    cap = CAPACITY_BLOCKS
    fmt = name.partition("-")[2] or "int8"
    if name == "hot":
        return HotTier(LAYOUT, cap * LAYOUT.fp16_bytes, "cpu")
    if name.startswith("warm"):
        layout = BlockLayout(3, 16, 64, warm_format=fmt)
        return WarmTier(layout, cap * layout.bytes_for(fmt), "cpu")
    if name == "cpu":
        return CpuTier(LAYOUT, cap * LAYOUT.fp16_bytes, memory_reserve=0)
    if name.startswith("cpu-"):
        return CpuTier(LAYOUT, cap * LAYOUT.bytes_for(fmt), dtype=fmt, memory_reserve=0)
    if name in ("redis", "redis-cluster"):
        url = request.getfixturevalue("redis_single" if name == "redis" else "redis_cluster").url
        probe = RedisTier(LAYOUT, url, 0)  # a default namespace: every tier's keys have its length
        value_bytes = LAYOUT.fp16_bytes + probe.value_overhead
        probe.close()
        return RedisTier(LAYOUT, url, cap * value_bytes)  # uncompressed: exactly CAPACITY_BLOCKS values
    # Uncompressed, so capacity in bytes is exactly CAPACITY_BLOCKS values.
    return SsdTier(LAYOUT, str(tmp_path / "lmdb"), cap * (LAYOUT.fp16_bytes + HEADER_BYTES), compression="none")


TIERS = ["hot", "warm", "warm-fp8", "warm-int4", "cpu", "cpu-int8", "cpu-fp8", "cpu-int4", "ssd", "redis",
         "redis-cluster"]
LOSSY = {"warm", "warm-fp8", "warm-int4", "cpu-int8", "cpu-fp8", "cpu-int4"}
AS_STORED = {"ssd", "redis", "redis-cluster"}  # hold every format as it comes


def random_blocks(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *LAYOUT.shape), generator=g) * 3
    x[:, 0, :, :, 5] *= 20  # an outlier channel in K, as real keys have
    return x.half()


def as_fp16(blocks) -> torch.Tensor:
    return dequantize(blocks) if isinstance(blocks, QuantBlocks) else blocks


@pytest.fixture(params=TIERS)
def tier(request, tmp_path):
    t = make_tier(request.param, tmp_path, request)
    t.lossy = request.param in LOSSY
    t.format = "float16" if not t.lossy else request.param.partition("-")[2] or "int8"
    t.keeps = lambda fmt: request.param in AS_STORED or t.format == fmt
    yield t
    t.close()


def test_round_trip(tier):
    x = random_blocks(5, seed=1)
    ids = [7, 3, 11, 2, 40]
    tier.put(ids, x)
    order = [40, 7, 2]
    got = as_fp16(tier.get(order)).float()
    want = x[[4, 0, 3]]
    if tier.lossy:
        assert ((got - want.float()).abs() <= error_bound(want, tier.format)).all()
    else:
        assert torch.equal(got.half(), want)
    tier.check_integrity()


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_blocks_keep_their_bytes_or_their_values(tier, fmt):
    x = random_blocks(2, seed=2)
    q = quantize(x, fmt, LAYOUT.int4_group)
    tier.put([1, 2], q)
    got = tier.get([1, 2])
    if tier.keeps(fmt):  # ssd, redis, a warm or cpu tier of this format: the bytes as they were put
        assert isinstance(got, QuantBlocks) and got.fmt == fmt
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got.tensors(), q.tensors()))
    elif not tier.lossy:  # fp16 tiers: the values
        assert torch.equal(got.cpu(), dequantize(q))
    else:  # requantized into the tier's format: both errors add up
        err = (as_fp16(got).float().cpu() - x.float()).abs()
        assert (err <= error_bound(x, fmt) + error_bound(dequantize(q), tier.format)).all()


def test_delete_frees_and_capacity_is_enforced(tier):
    x = random_blocks(CAPACITY_BLOCKS, seed=3)
    ids = list(range(CAPACITY_BLOCKS))
    tier.put(ids, x)
    assert tier.num_blocks == CAPACITY_BLOCKS
    assert not tier.can_put(1) and tier.free_blocks() == 0
    with pytest.raises((MemoryError, ValueError)):
        tier.put([99], random_blocks(1, seed=4))
    assert 99 not in tier and tier.num_blocks == CAPACITY_BLOCKS
    tier.delete(ids[:2])
    assert tier.can_put(2) and 0 not in tier and 2 in tier
    tier.put([99], random_blocks(1, seed=4))
    tier.delete([99] + ids[2:])
    assert tier.num_blocks == 0 and tier.used_bytes == 0
    tier.check_integrity()


def test_bad_input_changes_nothing(tier):
    with pytest.raises(ValueError, match="float16"):
        tier.put([1], random_blocks(1, seed=5).float())
    with pytest.raises(ValueError, match="ids"):
        tier.put([1, 2], random_blocks(1, seed=5))
    with pytest.raises(KeyError):
        tier.get([12345])
    assert tier.num_blocks == 0
    tier.check_integrity()


def test_int8_memory_really_halves():
    assert LAYOUT.int8_bytes < 0.6 * LAYOUT.fp16_bytes
    warm = WarmTier(LAYOUT, 10 * LAYOUT.fp16_bytes, "cpu")
    assert warm.slots.num_slots >= 17  # 10 fp16 blocks' bytes hold ~18 int8 blocks


def test_int8_error_bound_is_tight_and_holds():
    x = random_blocks(8, seed=6)
    err = (dequantize(quantize(x)).float() - x.float()).abs()
    bound = error_bound(x)
    assert (err <= bound).all()
    k_absmax = x[:, 0].float().abs().amax(dim=2, keepdim=True)  # per channel over tokens
    assert (err[:, 0] <= k_absmax / 254 + x[:, 0].float().abs() * 2**-10 + 1e-7).all()
    assert err.max() > 0.3 * (bound - x.float().abs() * 2**-10).max()  # rounding really happens
