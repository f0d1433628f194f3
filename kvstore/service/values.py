"""One tensor at rest in the sidecar: header + (optionally zstd) payload, two checksums.

    fixed header (36 bytes, little endian): magic b"KVTS", format version u16, dtype code u8,
        compression u8 (0 none, 1 zstd), ndim u8, 1 pad byte, key bytes u16, payload bytes u64,
        stored body bytes u64, xxh3-64 of the uncompressed payload u64
    shape: ndim x u64
    key: the LMDB key the value was written under (b"v/<namespace>/<key>")
    xxh3-64 of fixed header + shape + key, u64
    body: the payload, zstd-compressed when that saves at least 1/16 of it

The payload checksum is the one clients see (x-kvtier-checksum), so a value is verified
end to end: by the client on put, by the service on every read, by the client on get.
The key inside the header checksum makes a value whose LMDB key was damaged (renamed)
an integrity error instead of another key's data.

Format 1 (before the key was stored) had 3 pad bytes instead of pad + key length and no
key; such values are still read, without the key check. Every write is format 2.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash
import zstandard

from tiers.remote.wire import DTYPES, Descriptor
from tiers.base import IntegrityError

FORMAT_VERSION = 2
_FIXED = struct.Struct("<4sHBBBxHQQQ")
_MAGIC = b"KVTS"
_DTYPE_CODES = {name: code for code, name in enumerate(DTYPES)}
_DTYPE_NAMES = list(DTYPES)
_U64 = struct.Struct("<Q")


@dataclass(slots=True)
class Value:
    """A decoded, verified value; `payload` may be a view into the stored bytes."""

    desc: Descriptor
    payload: memoryview | bytes
    checksum: int


class ValueCodec:
    """Encodes and decodes stored values; zstd contexts are per instance (one per thread)."""

    def __init__(self, compression: str = "none", level: int = 1) -> None:
        if compression not in ("none", "zstd"):
            raise ValueError(f"compression must be 'none' or 'zstd', got {compression!r}")
        self.compressor = zstandard.ZstdCompressor(level=level) if compression == "zstd" else None
        self.decompressor = zstandard.ZstdDecompressor()

    def encode(self, desc: Descriptor, payload: bytes | memoryview, checksum: int, key: bytes) -> bytes:
        """The stored form of `payload` under LMDB key `key`; the caller computed (and checked) its xxh3-64."""
        body, compression = payload, 0
        if self.compressor is not None and len(payload) >= 4096:
            packed = self.compressor.compress(payload)
            if len(packed) <= len(payload) - len(payload) // 16:
                body, compression = packed, 1
        fixed = _FIXED.pack(_MAGIC, FORMAT_VERSION, _DTYPE_CODES[desc.dtype], compression, len(desc.shape),
                            len(key), len(payload), len(body), checksum)
        head = fixed + b"".join(_U64.pack(d) for d in desc.shape) + key
        return b"".join((head, _U64.pack(xxhash.xxh3_64_intdigest(head)), body))

    def decode(self, value: bytes | memoryview, what: str, key: bytes) -> Value:
        """Verify both checksums and that the value was written under `key`; IntegrityError on any damage."""
        view = memoryview(value)
        if len(view) < _FIXED.size:
            raise IntegrityError(f"{what}: stored value of {len(view)} bytes is shorter than its header")
        magic, version, dtype, compression, ndim, key_len, nbytes, stored, checksum = _FIXED.unpack_from(view)
        key_len = key_len if version == FORMAT_VERSION else 0  # format 1: these were pad bytes
        head_end = _FIXED.size + 8 * ndim + key_len
        if magic != _MAGIC or version not in (1, FORMAT_VERSION) or len(view) < head_end + 8:
            raise IntegrityError(f"{what}: stored value has a damaged header")
        (head_sum,) = _U64.unpack_from(view, head_end)
        if xxhash.xxh3_64_intdigest(view[:head_end]) != head_sum or dtype >= len(_DTYPE_NAMES):
            raise IntegrityError(f"{what}: header checksum mismatch")
        if version == FORMAT_VERSION and view[head_end - key_len: head_end] != key:
            written = bytes(view[head_end - key_len: head_end])
            raise IntegrityError(f"{what}: value was written under key {written!r}, found under {key!r} "
                                 "(a damaged LMDB key)")
        shape = tuple(_U64.unpack_from(view, _FIXED.size + 8 * i)[0] for i in range(ndim))
        body = view[head_end + 8:]
        if len(body) != stored:
            raise IntegrityError(f"{what}: stored body has {len(body)} bytes, header says {stored}")
        payload = body
        if compression:
            try:
                payload = self.decompressor.decompress(body, max_output_size=nbytes)
            except zstandard.ZstdError as exc:
                raise IntegrityError(f"{what}: compressed payload is damaged ({exc})") from None
        if len(payload) != nbytes or xxhash.xxh3_64_intdigest(payload) != checksum:
            raise IntegrityError(f"{what}: payload checksum mismatch")
        desc = Descriptor(_DTYPE_NAMES[dtype], shape)
        if desc.nbytes != nbytes:
            raise IntegrityError(f"{what}: {nbytes} payload bytes do not fit {desc}")
        return Value(desc, payload, checksum)
