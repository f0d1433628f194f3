"""The bytes of one block at rest: header + compressed payload, checksummed.

    header  (36 bytes, little endian): magic b"KVTB", layout version u16, format u8
            (0 fp16, 1 int8, 2 fp8, 3 int4: tiers/layout.py FORMAT_CODES), compression u8 (0 none, 1 zstd, 2 zstd over byte planes),
            kv_heads u32, block_tokens u32, head_dim u32, payload length u64,
            xxh3-64 of prefix + header-without-checksum + uncompressed payload u64
    payload fp16: the block's bytes [2, H, B, D]; quantized: data, then k_scale, then v_scale
    prefix  optional, before the header: a caller's envelope (the redis tier's block id and key
            name), covered by the checksum; the ssd tier stores none

A payload that zstd does not shrink is stored raw (compression 0), so a value never outgrows
its block plus header and prefix. Quantized payloads (int8, fp8, int4) are always stored raw, as a
save stores them (tiers/sealed_rows.py): zstd level 1 takes int8 K/V of the llama3-8b geometry from
70,692 to 68,024 bytes a 32-token block (3.8%) for ~90 us more to encode and ~65 us more to read back a
block on a CPU core (BENCHMARKS.md, Tiers), a cost the disk's bandwidth never repays.

The byte-plane split stores the low bytes of every fp16 value, then the high bytes. On
real SmolLM2 KV, one 12 KiB block per value, it gains nothing over plain zstd (1.074x vs
1.073x at level 1: bench_longctx.tiers_bench --kv-file; BENCHMARKS.md, Tiers) and costs ~20% speed, so
plain zstd level 1 is the default; the split stays selectable.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch
import xxhash
import zstandard

from tiers.base import IntegrityError
from tiers.layout import FORMAT_CODES, BlockLayout, Blocks, QuantBlocks, concat
from tiers.quant import dequantize

LAYOUT_VERSION = 1
_HEADER = struct.Struct("<4sHBBIIIQQ")
_MAGIC = b"KVTB"
HEADER_BYTES = _HEADER.size
COMPRESSIONS = {"none": 0, "zstd": 1, "zstd-split": 2}
_FORMAT_NAMES = {code: name for name, code in FORMAT_CODES.items()}


class Codec:
    """Encodes and decodes single blocks; one per thread (zstd contexts are not shared)."""

    def __init__(self, compression: str = "zstd", level: int = 1) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {sorted(COMPRESSIONS)}, got {compression!r}")
        self.compression = COMPRESSIONS[compression]
        self.compressor = zstandard.ZstdCompressor(level=level)
        self.decompressor = zstandard.ZstdDecompressor()

    def encode(self, layout: BlockLayout, blocks: Blocks, row: int, prefix: bytes = b"") -> bytes:
        """Row `row` of a CPU batch -> one stored value: `prefix` (a caller's envelope, e.g. the
        redis tier's key name; the checksum covers it), then header and payload, copied once."""
        return b"".join(self.encode_parts(layout, blocks, row, prefix))

    def encode_parts(self, layout: BlockLayout, blocks: Blocks, row: int, prefix: bytes = b"") -> list[bytes | memoryview]:
        """encode()'s value as consecutive pieces, the payload a view of the batch where stored raw."""
        if isinstance(blocks, QuantBlocks):
            fmt = FORMAT_CODES[blocks.fmt]
            payload = b"".join(t[row].contiguous().view(torch.uint8).numpy() for t in blocks.tensors())
        else:
            fmt, payload = FORMAT_CODES["float16"], memoryview(blocks[row].contiguous().view(torch.uint8).numpy().reshape(-1))
        body, compression = payload, self.compression if fmt == FORMAT_CODES["float16"] else 0
        if compression:
            body = self.compressor.compress(_split_planes(payload) if compression == 2 else payload)
            if len(body) >= len(payload):  # incompressible: stored raw, so a value never outgrows its block
                body, compression = payload, 0
        header = _HEADER.pack(_MAGIC, LAYOUT_VERSION, fmt, compression, layout.num_kv_heads,
                              layout.block_tokens, layout.head_dim, len(payload), 0)[:-8]
        return [prefix, header, struct.pack("<Q", _digest(prefix, header, payload)), body]

    def decode(self, layout: BlockLayout, value: bytes | memoryview, what: str, prefix: int = 0) -> Blocks:
        """One stored value (after a `prefix`-byte envelope) -> a batch of one block.
        Raises IntegrityError on any damage."""
        return _unpack(layout, *self.verify(layout, value, what, prefix))

    def verify(self, layout: BlockLayout, value: bytes | memoryview, what: str, prefix: int = 0) -> tuple[int, bytes | memoryview]:
        """Checks one stored value; returns its format and its payload (a view where stored raw)."""
        view = memoryview(value)
        if len(view) < prefix + _HEADER.size:
            raise IntegrityError(f"{what}: value of {len(view)} bytes is shorter than its header")
        magic, version, fmt, comp, h, b, d, length, digest = _HEADER.unpack_from(view, prefix)
        if magic != _MAGIC or version != LAYOUT_VERSION or (h, b, d) != (
            layout.num_kv_heads, layout.block_tokens, layout.head_dim
        ):
            raise IntegrityError(f"{what}: header does not match layout v{LAYOUT_VERSION} {layout}")
        body = view[prefix + _HEADER.size:]
        try:
            payload = self.decompressor.decompress(body, max_output_size=length) if comp else body
        except zstandard.ZstdError as exc:
            raise IntegrityError(f"{what}: compressed payload is damaged ({exc})") from None
        if comp == 2 and fmt == 0:
            payload = _join_planes(payload)
        if len(payload) != length or _digest(view[:prefix], view[prefix: prefix + _HEADER.size - 8], payload) != digest:
            raise IntegrityError(f"{what}: checksum mismatch")
        # a length fixes int4's grouping too: a value written under another int4_group does not fit
        if fmt not in _FORMAT_NAMES or length != layout.bytes_for(_FORMAT_NAMES[fmt]):
            raise IntegrityError(f"{what}: format {fmt} with {length} payload bytes does not fit {layout}")
        return fmt, payload


class BatchDecoder:
    """Verified values -> one batch, filled row by row as values arrive (a caller can drop each
    value once added). fp16 payloads are copied once into the batch; a batch mixing formats comes back
    fp16 (quantized ones dequantized), one of only quantized blocks of one format as QuantBlocks."""

    def __init__(self, codec: Codec, layout: BlockLayout, n: int, prefix: int = 0) -> None:
        self.codec, self.layout, self.n, self.prefix = codec, layout, n, prefix
        self.out: torch.Tensor | None = None  # [n, 2, H, B, D], allocated at the first fp16 block
        self.quant_rows: dict[int, QuantBlocks] = {}

    def add(self, row: int, value: bytes | memoryview, what: str) -> None:
        """Raises IntegrityError on any damage."""
        fmt, payload = self.codec.verify(self.layout, value, what, self.prefix)
        if fmt != FORMAT_CODES["float16"]:
            self.quant_rows[row] = _unpack(self.layout, fmt, payload)
            return
        if self.out is None:
            self.out = self.layout.empty_fp16(self.n, "cpu")
        self.out.view(self.n, -1).view(torch.uint8).numpy()[row] = np.frombuffer(payload, np.uint8)

    def result(self) -> Blocks:
        if self.out is None and len({q.fmt for q in self.quant_rows.values()}) > 1:
            self.out = self.layout.empty_fp16(self.n, "cpu")  # quantized blocks of two formats: all fp16
        if self.out is None:
            return concat([self.quant_rows[r] for r in range(self.n)]) if self.n else self.layout.empty_fp16(0, "cpu")
        for row, part in self.quant_rows.items():
            self.out[row] = dequantize(part)[0]
        return self.out


def _digest(prefix: bytes | memoryview, header: bytes | memoryview, payload: bytes | memoryview) -> int:
    """xxh3-64 of prefix + header + payload, streamed (no concatenated copy); equal to the
    one-shot digest of the concatenation, so values written without a prefix still verify."""
    h = xxhash.xxh3_64()
    h.update(prefix)
    h.update(header)
    h.update(payload)
    return h.intdigest()


def _split_planes(payload: bytes) -> bytes:
    """fp16 bytes -> all low bytes, then all high bytes."""
    words = np.frombuffer(payload, np.uint16)
    return (words & 0xFF).astype(np.uint8).tobytes() + (words >> 8).astype(np.uint8).tobytes()


def _join_planes(planes: bytes) -> bytes:
    half = len(planes) // 2
    low = np.frombuffer(planes, np.uint8, count=half).astype(np.uint16)
    high = np.frombuffer(planes, np.uint8, offset=half).astype(np.uint16)
    return (low | (high << 8)).tobytes()


def _unpack(layout: BlockLayout, fmt: int, payload: bytes) -> Blocks:
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    specs = layout.field_specs(_FORMAT_NAMES[fmt])
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    parts = [t.view(dtype).reshape(1, *shape) for t, (shape, dtype) in zip(torch.split(raw, sizes), specs)]
    return parts[0] if len(parts) == 1 else QuantBlocks(*parts)
