"""A block already in the warm format never goes up into the hot tier as fp16: it lands in the warm tier with its
bytes as they were. Dequantized into the hot tier and cooled again, an int4 block would be quantized a second time,
which does not give back the same codes for every block (int8 and fp8 do), so a loaded context would drift from
the one saved."""

from __future__ import annotations

import pytest
import torch

from kvstore import Config, KVStore, ModelSpec
from kvstore.blocks.tierset import CPU_TIER, HOT_TIER, WARM_TIER
from tiers.quant import dequantize, quantize

SPEC = ModelSpec(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64)
GROUP = 32


def requantizes_differently(seed: int) -> torch.Tensor:
    """fp16 K/V [B, H, D] of one 32-token block whose int4 codes, dequantized and quantized again, change."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(200):
        kv = (torch.randn(2, 32, 2, 64, generator=g) * 40 + torch.randn(1, generator=g) * 20).half()
        once = dequantize(quantize(kv.permute(0, 2, 1, 3)[None], "int4", GROUP))
        if not torch.equal(dequantize(quantize(once, "int4", GROUP)), once):
            return kv
    raise AssertionError("no such block found")


def test_requantizing_int4_is_not_exact_for_this_block():
    kv = requantizes_differently(0)
    once = dequantize(quantize(kv.permute(0, 2, 1, 3)[None], "int4", GROUP))
    assert not torch.equal(dequantize(quantize(once, "int4", GROUP)), once)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
def test_a_warm_format_block_moved_toward_the_hot_tier_keeps_its_bytes_in_the_warm_tier(tmp_path, fmt):
    config = Config(model=SPEC, block_tokens=32, sink_tokens=32, hot_tokens=64, warm_tokens=1 << 20,
                    gpu_bytes=8 << 20, cpu_bytes=8 << 20, cpu_dtype=fmt, warm_format=fmt, int4_group=GROUP,
                    device="cpu", host_memory_reserve=0)
    kv = requantizes_differently(0)
    with KVStore(config) as store:
        seq = store.create_sequence()
        filler = torch.zeros(32, 2, 64, dtype=torch.float16)
        store.append(seq, 0, filler, filler)  # the sink block
        store.append(seq, 0, kv[0], kv[1])  # block 1
        store.append(seq, 0, *(torch.zeros(96, 2, 64, dtype=torch.float16),) * 2)  # block 1 leaves the hot window
        tiers, block = store.tiers, store.table(seq, 0).block_ids[1]
        assert tiers.blocks.tier_of[block] == WARM_TIER
        want = tiers.warm.get([block])
        tiers.move([block], WARM_TIER, CPU_TIER)
        tiers.move([block], CPU_TIER, HOT_TIER)  # as loading a saved block whose position is in the hot window
        assert tiers.blocks.tier_of[block] == WARM_TIER
        got = tiers.warm.get([block])
        assert all(torch.equal(a, b) for a, b in zip(got.tensors(), want.tensors()))
        store.check_integrity()


def test_a_tail_is_placed_in_the_hot_tier_whatever_format_it_arrives_in(tmp_path):
    """keep_format=False (TierSet.pin_tail: DecodeStep addresses a tail by its hot slot) moves it up all the same;
    with the format kept, a warm block bound for the hot tier stays where it is."""
    config = Config(model=SPEC, block_tokens=32, sink_tokens=32, hot_tokens=64, warm_tokens=1 << 20,
                    gpu_bytes=8 << 20, cpu_bytes=8 << 20, warm_format="int4", int4_group=GROUP, device="cpu",
                    host_memory_reserve=0)
    with KVStore(config) as store:
        seq = store.create_sequence()
        store.append(seq, 0, *(torch.randn(160, 2, 64).half(),) * 2)
        tiers, block = store.tiers, store.table(seq, 0).block_ids[1]
        assert tiers.blocks.tier_of[block] == WARM_TIER
        tiers.move([block], WARM_TIER, HOT_TIER)
        assert tiers.blocks.tier_of[block] == WARM_TIER
        tiers.move([block], WARM_TIER, HOT_TIER, coldest=HOT_TIER, keep_format=False)
        assert tiers.blocks.tier_of[block] == HOT_TIER
        store.check_integrity()


@pytest.mark.parametrize("cpu_dtype", ["auto", "float16"])
def test_an_int4_block_cooled_into_the_cpu_tier_and_promoted_keeps_its_bytes_by_default(tmp_path, cpu_dtype):
    """The default cpu_dtype ("auto") holds an int4 store's cpu blocks as int4, so a block that cools out of the
    warm tier and is promoted back returns with its bytes; an fp16 cpu tier quantizes it a second time."""
    config = Config(model=SPEC, block_tokens=32, sink_tokens=32, hot_tokens=64, warm_tokens=1 << 20,
                    gpu_bytes=8 << 20, cpu_bytes=8 << 20, cpu_dtype=cpu_dtype, warm_format="int4",
                    int4_group=GROUP, device="cpu", host_memory_reserve=0)
    assert config.cpu_dtype == ("int4" if cpu_dtype == "auto" else "float16")
    kv = requantizes_differently(0)
    with KVStore(config) as store:
        seq = store.create_sequence()
        store.append(seq, 0, *(torch.zeros(32, 2, 64, dtype=torch.float16),) * 2)  # the sink block
        store.append(seq, 0, kv[0], kv[1])  # block 1
        store.append(seq, 0, *(torch.zeros(96, 2, 64, dtype=torch.float16),) * 2)  # block 1 leaves the hot window
        tiers, block = store.tiers, store.table(seq, 0).block_ids[1]
        want = tiers.warm.get([block])
        tiers.move([block], WARM_TIER, CPU_TIER)
        assert tiers.promote([block]) == 1 and tiers.blocks.tier_of[block] == WARM_TIER
        got = tiers.warm.get([block])
        same = all(torch.equal(a, b) for a, b in zip(got.tensors(), want.tensors()))
        assert same == (cpu_dtype == "auto")
        store.check_integrity()
