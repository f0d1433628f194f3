"""tiers/stored.py: stored values of both formats -> one verified batch per format, each block as Codec.decode
reads it alone; damage anywhere refuses the whole batch. Also through the ssd tier (fetch_as_stored, and get)."""

from __future__ import annotations

import pytest
import torch

from tiers.base import IntegrityError
from tiers.codec import Codec
from tiers.layout import BlockLayout, QuantBlocks
from tiers.quant import dequantize, quantize
from tiers.ssd import SsdTier
from tiers.stored import decode_as_stored

LAYOUT = BlockLayout(num_kv_heads=3, block_tokens=16, head_dim=40)  # irregular: sizes no power of two
FORMATS = "ffiifiiif"  # fp16 and int8 blocks interleaved


def blocks(seed: int) -> list[torch.Tensor | QuantBlocks]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn((len(FORMATS), *LAYOUT.shape), generator=g) * 3).half()
    return [x[i: i + 1] if f == "f" else quantize(x[i: i + 1]) for i, f in enumerate(FORMATS)]


def encoded(parts: list, compression: str) -> list[bytes]:
    codec = Codec(compression)
    return [codec.encode(LAYOUT, part, 0) for part in parts]


def same(a: torch.Tensor | QuantBlocks, b: torch.Tensor | QuantBlocks) -> bool:
    a, b = (x.tensors() if isinstance(x, QuantBlocks) else (x,) for x in (a, b))
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("compression", ["none", "zstd", "zstd-split"])
def test_each_block_comes_back_as_codec_decode_reads_it_in_one_batch_per_format(compression):
    values = encoded(blocks(1), compression)
    ids = [100 + i for i in range(len(values))]
    got = decode_as_stored(Codec(), LAYOUT, ids, [memoryview(v) for v in values], "test", "cpu")
    assert got.fp16_at == [i for i, f in enumerate(FORMATS) if f == "f"]
    assert got.quant_at == [i for i, f in enumerate(FORMATS) if f == "i"]
    want = [Codec().decode(LAYOUT, v, "one") for v in values]
    assert same(got.fp16, torch.cat([want[i] for i in got.fp16_at]))
    for row, i in enumerate(got.quant_at):
        assert same(got.quant.index(slice(row, row + 1)), want[i])
    for t in (got.fp16, *got.quant.tensors()):
        assert t.is_contiguous() and t.data_ptr() % 16 == 0
    mixed = got.one_format()  # the tier's get: all in order, fp16 with int8 ones dequantized
    for i, w in enumerate(want):
        assert torch.equal(mixed[i: i + 1], dequantize(w) if isinstance(w, QuantBlocks) else w)


@pytest.mark.parametrize("only", ["f", "i", ""])
def test_one_format_or_none(only):
    parts = [p for p, f in zip(blocks(2), FORMATS) if f == only]
    got = decode_as_stored(Codec(), LAYOUT, list(range(len(parts))), encoded(parts, "zstd"), "test", "cpu")
    assert len(got.fp16_at) + len(got.quant_at) == len(parts)
    assert got.fp16.shape == (len(got.fp16_at), *LAYOUT.shape) and len(got.quant) == len(got.quant_at)
    whole = got.one_format()
    assert (isinstance(whole, QuantBlocks) if only == "i" else whole.dtype == torch.float16)


@pytest.mark.parametrize("offset", [3, 20, 200, -1])
def test_one_damaged_value_refuses_the_batch_and_names_its_block(offset):
    values = [bytearray(v) for v in encoded(blocks(3), "none")]
    values[4][offset] ^= 0x10
    with pytest.raises(IntegrityError, match="test block 104"):
        decode_as_stored(Codec(), LAYOUT, [100 + i for i in range(len(values))], values, "test", "cpu")


def test_ssd_tier_fetches_as_stored_and_gets_one_format(tmp_path):
    parts = blocks(4)
    tier = SsdTier(LAYOUT, str(tmp_path / "db"), 1 << 26)
    for i, part in enumerate(parts):
        tier.put([i], part)
    order = [5, 0, 8, 2, 3]
    got = tier.fetch_as_stored(order, "cpu")
    assert [order[r] for r in got.fp16_at] == [i for i in order if FORMATS[i] == "f"]
    assert same(got.fp16, torch.cat([parts[order[r]] for r in got.fp16_at]))
    for row, r in enumerate(got.quant_at):
        assert same(got.quant.index(slice(row, row + 1)), parts[order[r]])
    mixed = tier.get(order)
    assert all(torch.equal(mixed[j: j + 1], dequantize(parts[i]) if FORMATS[i] == "i" else parts[i])
               for j, i in enumerate(order))
    with pytest.raises(KeyError, match="not stored"):
        tier.fetch_as_stored([0, 42], "cpu")
    tier.check_integrity()
    tier.close()
