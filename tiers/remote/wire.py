"""What travels between the sidecar and its clients: names, descriptors and batch framing.

Single values travel as raw bytes (application/octet-stream, C order, little endian)
with a layout descriptor in headers:

    x-kvtier-dtype: float16 | bfloat16 | float32 | int8 | uint8 | int32
    x-kvtier-shape: comma separated dims, e.g. "2,8,32,128" ("" is a 0-d tensor)
    x-kvtier-layout: 1              (this file's LAYOUT_VERSION)
    x-kvtier-checksum: xxh3-64 of the bytes, 16 hex digits (optional on PUT; always on GET)

Batches (batch put bodies and batch get responses) are one application/octet-stream
body framed as

    u64 little endian L | L bytes of UTF-8 JSON index | zero padding | payloads

    index = {"layout": 1, "items": [{"key": str, "dtype": str, "shape": [int, ...],
                                     "offset": int, "nbytes": int, "checksum": "16 hex"}]}

`offset` counts from the start of the body and is a multiple of 64, so every payload
can be viewed in place as its dtype. `checksum` is optional in a batch put. The prefix
routes (/v1/prefix/...) use the same framing with a chunk hash as each item's key:
32 lowercase hex digits of a tiers/keys.py chain hash. This file
imports neither torch nor the server, so the client and the service share it.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass

LAYOUT_VERSION = 1
DTYPES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4, "int8": 1, "uint8": 1, "int32": 4}
MAX_NDIM = 8
ALIGN = 64
MAX_INDEX_BYTES = 16 << 20
MAX_KEY_BYTES = 400

H_DTYPE, H_SHAPE, H_LAYOUT, H_CHECKSUM = "x-kvtier-dtype", "x-kvtier-shape", "x-kvtier-layout", "x-kvtier-checksum"

_CHUNK_HASH = re.compile(r"[0-9a-f]{32}")
_NAMESPACE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_SEGMENT = re.compile(r"[A-Za-z0-9_.~:@+=-]+")
_LENGTH = struct.Struct("<Q")


class WireError(ValueError):
    """A request that does not follow this protocol; the service answers 400 with the message."""


@dataclass(frozen=True, slots=True)
class Descriptor:
    """dtype and shape of one tensor's bytes."""

    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise WireError(f"unsupported dtype {self.dtype!r}; expected one of {sorted(DTYPES)}")
        if len(self.shape) > MAX_NDIM:
            raise WireError(f"shape has {len(self.shape)} dims; at most {MAX_NDIM} are supported")
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 or d >= 1 << 40 for d in self.shape):
            raise WireError(f"shape must be a list of non-negative ints below 2**40, got {list(self.shape)}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype]

    def headers(self) -> dict[str, str]:
        return {H_DTYPE: self.dtype, H_SHAPE: ",".join(map(str, self.shape)), H_LAYOUT: str(LAYOUT_VERSION)}

    @staticmethod
    def from_headers(dtype: str, shape: str, layout: str) -> Descriptor:
        check_layout(layout)
        text = shape.strip()
        parts = [p.strip() for p in text.split(",")] if text else []
        if not all(p.isdigit() and p.isascii() and len(p) <= 13 for p in parts):
            raise WireError(f"{H_SHAPE} must be comma separated non-negative ints, got {shape!r}")
        return Descriptor(dtype.strip(), tuple(int(p) for p in parts))


def check_layout(layout: object) -> None:
    if str(layout).strip() != str(LAYOUT_VERSION):
        raise WireError(f"unsupported layout version {layout!r}; this server speaks layout {LAYOUT_VERSION}")


def check_namespace(namespace: str) -> None:
    if not _NAMESPACE.fullmatch(namespace) or namespace in (".", ".."):
        raise WireError(f"namespace must be 1-64 characters of [A-Za-z0-9_.-], got {namespace!r}")


def check_key(key: str) -> None:
    segments = key.split("/")
    bad = [s for s in segments if not _SEGMENT.fullmatch(s) or s in (".", "..")]
    if bad or len(key.encode()) > MAX_KEY_BYTES:
        raise WireError(
            f"key must be up to {MAX_KEY_BYTES} bytes of '/'-separated non-empty segments "
            f"of [A-Za-z0-9_.~:@+=-] (not '.' or '..'), got {key!r}"
        )


def check_chunk_hash(text: str) -> None:
    if not isinstance(text, str) or not _CHUNK_HASH.fullmatch(text):
        raise WireError(f"chunk hash must be 32 lowercase hex digits (a 16-byte chain hash), got {str(text)[:80]!r}")


def chunk_key(chunk_hash: str) -> str:
    """The key a prompt chunk is stored under in its namespace, by every chunk store (sidecar, local, Redis)."""
    return "chunk/" + chunk_hash


def check_prefix(prefix: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9_.~:@+=/-]*", prefix) or len(prefix.encode()) > MAX_KEY_BYTES:
        raise WireError(f"prefix must be up to {MAX_KEY_BYTES} bytes of key characters, got {prefix!r}")


def parse_checksum(text: str | None) -> int | None:
    if text is None:
        return None
    if not re.fullmatch(r"[0-9a-fA-F]{1,16}", text.strip()):
        raise WireError(f"checksum must be up to 16 hex digits (xxh3-64), got {text!r}")
    return int(text, 16)


def format_checksum(value: int) -> str:
    return f"{value:016x}"


# -- batch framing ---------------------------------------------------------------------------
def pack_batch(items: list[tuple[str, Descriptor, int | None]], payloads: list) -> list:
    """(key, descriptor, checksum) items and their byte payloads -> the chunks of one framed body."""
    relative = _relative_offsets(payloads)
    entries = []
    for (key, desc, checksum), payload in zip(items, payloads, strict=True):
        entry = {"key": key, "dtype": desc.dtype, "shape": list(desc.shape), "offset": 0, "nbytes": len(payload)}
        if checksum is not None:
            entry["checksum"] = format_checksum(checksum)
        entries.append(entry)
    start = 0  # where payloads begin; it depends on the index's length, which depends on it
    while True:
        for entry, rel in zip(entries, relative):
            entry["offset"] = start + rel
        index = json.dumps({"layout": LAYOUT_VERSION, "items": entries}, separators=(",", ":")).encode()
        if _aligned(_LENGTH.size + len(index)) == start:
            break
        start = _aligned(_LENGTH.size + len(index))
    chunks: list = [_LENGTH.pack(len(index)), index, bytes(start - _LENGTH.size - len(index))]
    position = start
    for payload, rel in zip(payloads, relative):
        if start + rel > position:
            chunks.append(bytes(start + rel - position))  # zero padding up to the aligned offset
        chunks.append(payload)
        position = start + rel + len(payload)
    return chunks


def unpack_batch(body: memoryview | bytes) -> list[tuple[str, Descriptor, int | None, int, int]]:
    """A framed body -> [(key, descriptor, checksum or None, offset, nbytes)], every range checked."""
    if len(body) < _LENGTH.size:
        raise WireError(f"batch body has {len(body)} bytes; it must start with a u64 index length")
    (length,) = _LENGTH.unpack_from(body)
    if length > min(MAX_INDEX_BYTES, len(body) - _LENGTH.size):
        raise WireError(f"batch index length {length} does not fit in a body of {len(body)} bytes")
    try:
        index = json.loads(bytes(body[_LENGTH.size: _LENGTH.size + length]))
        check_layout(index["layout"])
        raw_items = index["items"]
        if not isinstance(raw_items, list):
            raise TypeError("items must be a list")
        items = [_unpack_item(item, len(body), _LENGTH.size + length) for item in raw_items]
    except WireError:
        raise
    except RecursionError:  # json.loads of deeply nested arrays: bad input, not a server fault
        raise WireError("batch index is nested too deeply to be a batch index") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise WireError(f"batch index is malformed ({type(exc).__name__}: {exc}); see tiers/remote/wire.py") from None
    keys = [item[0] for item in items]
    if len(set(keys)) != len(keys):
        raise WireError("batch has duplicate keys")
    return items


def _unpack_item(item: dict, body_len: int, payload_start: int) -> tuple[str, Descriptor, int | None, int, int]:
    key, offset, nbytes = item["key"], item["offset"], item["nbytes"]
    if not isinstance(key, str) or not isinstance(item["shape"], list) or not isinstance(item["dtype"], str):
        raise WireError(f"batch item needs str key, str dtype and list shape, got {item!r}"[:300])
    check_key(key)
    desc = Descriptor(item["dtype"], tuple(item["shape"]))
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (offset, nbytes)):
        raise WireError(f"batch item {key!r}: offset and nbytes must be ints")
    if nbytes != desc.nbytes:
        raise WireError(f"batch item {key!r}: nbytes {nbytes} != {desc.dtype} {list(desc.shape)} needs {desc.nbytes}")
    if offset < payload_start or offset + nbytes > body_len:
        raise WireError(f"batch item {key!r}: bytes [{offset}, {offset + nbytes}) lie outside the payload region "
                        f"[{payload_start}, {body_len})")
    checksum = item.get("checksum")
    return key, desc, parse_checksum(checksum) if checksum is not None else None, offset, nbytes


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _relative_offsets(payloads: list) -> list[int]:
    out, offset = [], 0
    for payload in payloads:
        out.append(offset)
        offset = _aligned(offset + len(payload))
    return out
