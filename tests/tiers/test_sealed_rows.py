"""tiers/sealed_rows.py: a batch encoded by whole-batch copies gives, row for row, the bytes of
seal(key, Codec.encode(row)) (quantized rows raw, fp16 rows as the codec compresses), and reads back."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tiers.codec import Codec
from tiers.errors import IntegrityError
from tiers.layout import BlockLayout
from tiers.quant import quantize
from tiers.saved import seal, unseal
from tiers.sealed_rows import format_code, sealed_rows

LAYOUT = BlockLayout(num_kv_heads=3, block_tokens=16, head_dim=40, int4_group=8)  # irregular sizes


def batch(fmt: str):
    x = (torch.randn((6, *LAYOUT.shape), generator=torch.Generator().manual_seed(3)) * 3).half()
    return x if fmt == "float16" else quantize(x, fmt, LAYOUT.int4_group)


@pytest.mark.parametrize("fmt", ["float16", "int8", "fp8", "int4"])
@pytest.mark.parametrize("compression", [("none", 1), ("zstd", 1), ("zstd-split", 3)])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4, 5], [4, 1, 5], [2]])
def test_rows_are_the_sealed_codec_values(fmt, compression, rows):
    blocks = batch(fmt)
    keys = [b"ctx/block/" + bytes([i]) * 18 for i in rows]
    with ThreadPoolExecutor(2) as pool:
        got = sealed_rows(compression, LAYOUT, blocks, rows, [seal(k, b"") for k in keys], pool)
    codec = Codec(*compression) if fmt == "float16" else Codec("none")  # quantized payloads stay raw
    assert [bytes(v) for v in got] == [seal(k, codec.encode(LAYOUT, blocks, r)) for k, r in zip(keys, rows)]
    for k, v, r in zip(keys, got, rows):
        decoded = Codec().decode(LAYOUT, unseal(k, v, "test"), "test")
        want = blocks[r: r + 1] if fmt == "float16" else blocks.index(slice(r, r + 1))
        for a, b in zip(getattr(decoded, "tensors", lambda: (decoded,))(), getattr(want, "tensors", lambda: (want,))()):
            assert torch.equal(a, b)
    assert format_code(LAYOUT, blocks) == bytes(got[0])[len(seal(keys[0], b"")) + 6]


def test_a_damaged_row_is_refused():
    blocks = batch("int8")
    value = bytearray(sealed_rows(("none", 1), LAYOUT, blocks, [1], [seal(b"k", b"")])[0])
    value[len(value) // 2] ^= 1
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        Codec().decode(LAYOUT, unseal(b"k", value, "test"), "test")
