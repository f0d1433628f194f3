"""A batch of blocks as saved values, encoded in whole-batch copies (a save's hot loop).

A saved value is tiers/saved.py's `seal(key, codec value)`: b"KVSV", key length, key, then the codec
value (tiers/codec.py: 36-byte header with the xxh3-64 of header and payload, then the payload). Encoding
a million blocks one by one (payload join, header, value join, seal join: four copies and a dozen Python
calls a block) ran a save at ~0.3 GB/s; here every uncompressed row of a batch is laid out in one buffer:
the keys' envelopes, the shared header and the payload fields go in with one numpy copy per column range,
and a block costs one xxh3 pass and one 8-byte digest. Values are handed out as views of that buffer.

Quantized payloads are stored raw: zstd leaves int8 K/V at ~1.0x (BENCHMARKS.md, Tiers), so compressing
them costs time and saves nothing. fp16 payloads follow the codec's setting (zstd ~1.07x on real K/V); they
are compressed on a thread pool (zstd drops the GIL), one Codec per thread.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import torch
import xxhash

from tiers.codec import COMPRESSIONS, HEADER_BYTES, Codec
from tiers.layout import BlockLayout, Blocks

_RAW = Codec("none")  # its encode_parts gives the header a raw row of any format carries
_HEADER_PART = HEADER_BYTES - 8  # the header before its digest
_local = threading.local()


def sealed_rows(codec: tuple[str, int], layout: BlockLayout, blocks: Blocks, rows: Sequence[int],
                heads: Sequence[bytes], pool: ThreadPoolExecutor | None = None) -> list[bytes | memoryview]:
    """Rows `rows` of a CPU batch as saved values: heads[i] (the envelope naming row i's key) followed by the
    codec value Codec(*codec).encode would store for that row. Quantized rows, and fp16 rows under a codec
    without compression, come back as views of one new buffer; compressed fp16 rows are encoded on `pool`."""
    if not len(rows):
        return []
    quantized = not isinstance(blocks, torch.Tensor)
    if not quantized and COMPRESSIONS[codec[0]]:
        return _compressed(codec, layout, blocks, rows, heads, pool)
    head_len = len(heads[0])
    if any(len(h) != head_len for h in heads):  # keys of mixed lengths: one row at a time
        return [h + b"".join(_RAW.encode_parts(layout, blocks, r)) for r, h in zip(rows, heads)]
    header = bytes(_RAW.encode_parts(layout, blocks, rows[0])[1])  # format, geometry, length; compression 0
    index = np.asarray(rows, dtype=np.int64)
    if index[-1] - index[0] == len(index) - 1 and (len(index) == 1 or bool((np.diff(index) == 1).all())):
        index = slice(int(index[0]), int(index[-1]) + 1)  # consecutive rows: copied from a view, no gathered copy
    fields = [_byte_rows(t) for t in (blocks.tensors() if quantized else (blocks,))]  # [N, bytes] each
    start = head_len + HEADER_BYTES
    out = np.empty((len(rows), start + sum(f.shape[1] for f in fields)), dtype=np.uint8)  # [n, value bytes]
    out[:, :head_len] = np.frombuffer(b"".join(heads), dtype=np.uint8).reshape(len(rows), head_len)
    out[:, head_len: head_len + _HEADER_PART] = np.frombuffer(header, dtype=np.uint8)
    at = start
    for f in fields:
        out[:, at: at + f.shape[1]] = f[index]
        at += f.shape[1]
    base = xxhash.xxh3_64()
    base.update(header)  # codec.py's digest: (no prefix) + header without digest + payload
    digests = np.empty(len(rows), dtype="<u8")
    for i in range(len(rows)):
        h = base.copy()
        h.update(out[i, start:])
        digests[i] = h.intdigest()
    out[:, head_len + _HEADER_PART: start] = digests.view(np.uint8).reshape(len(rows), 8)
    return [memoryview(row) for row in out]


def _compressed(codec: tuple[str, int], layout: BlockLayout, blocks: torch.Tensor, rows: Sequence[int],
                heads: Sequence[bytes], pool: ThreadPoolExecutor | None) -> list[bytes]:
    def one(r: int, head: bytes) -> bytes:
        codecs = _local.__dict__.setdefault("codecs", {})  # zstd contexts are not shared between threads
        mine = codecs.get(codec) or codecs.setdefault(codec, Codec(*codec))
        return head + b"".join(mine.encode_parts(layout, blocks, r))

    if pool is None:
        return [one(r, h) for r, h in zip(rows, heads)]
    return list(pool.map(one, rows, heads))


def _byte_rows(t: torch.Tensor) -> np.ndarray:
    """A [rows, bytes] uint8 numpy view of a contiguous CPU tensor (a copy if it is not contiguous)."""
    return t.contiguous().view(t.shape[0], -1).view(torch.uint8).numpy()


def format_code(layout: BlockLayout, blocks: Blocks) -> int:
    """The format byte (tiers/codec.py's header) the values of a non-empty batch carry."""
    return bytes(_RAW.encode_parts(layout, blocks, 0)[1])[6]
