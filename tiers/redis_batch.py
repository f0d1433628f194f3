"""A get's batch, each stored value received straight into it from the socket.

A raw fp16 value (envelope, codec header, payload) is received so that its payload lands in its
own row of the batch: the envelope and header then sit over the last bytes of the row before
(row 0: a pad in front of the batch), which are kept aside and put back once the value is
verified, so every received row stays exact whatever order the values come in. The checksum is
checked where the bytes landed; nothing is copied. Other values (zstd, int8, a length that does
not fit) are received into a scratch buffer and go through BatchDecoder as before.
"""

from __future__ import annotations

from typing import Callable

import torch

from tiers.codec import HEADER_BYTES, BatchDecoder, Codec
from tiers.layout import BlockLayout, Blocks

_ALIGN = 64  # the batch's first row starts on a cache line


class InPlaceBatch:
    def __init__(self, codec: Codec, layout: BlockLayout, n: int, envelope_bytes: int) -> None:
        self.codec, self.layout, self.envelope_bytes = codec, layout, envelope_bytes
        self.head = envelope_bytes + HEADER_BYTES  # bytes of a value before its payload
        self.row_bytes = layout.fp16_bytes
        self.pad = -(-self.head // _ALIGN) * _ALIGN
        # Not touched here: pages are faulted in by the socket reads that fill them.
        self.memory = torch.empty(self.pad + n * self.row_bytes, dtype=torch.uint8)  # [pad + n * row_bytes]
        self.bytes = memoryview(self.memory.numpy())
        self.decoder = BatchDecoder(codec, layout, n, prefix=envelope_bytes)
        self.decoder.out = self.memory[self.pad:].view(torch.float16).view(n, *layout.shape)  # [n, 2, H, B, D]
        self.num_fp16_rows = 0

    def receive(self, row: int, length: int, fill: Callable[[memoryview], None],
                check_envelope: Callable[[memoryview], None], what: str) -> None:
        """fill(dest) writes the `length`-byte value of `row` into dest; raises IntegrityError on any damage."""
        if length != self.head + self.row_bytes:
            value = memoryview(bytearray(length))
            fill(value)
            check_envelope(value)
            self._decode(row, value, what)
            return
        start = self.pad + row * self.row_bytes - self.head
        covered = bytes(self.bytes[start: start + self.head])  # the tail of the row before
        value = self.bytes[start: start + length]
        fill(value)
        check_envelope(value)
        fmt, payload = self.codec.verify(self.layout, value, what, self.envelope_bytes)
        stored_raw = fmt == 0 and isinstance(payload, memoryview)  # else another writer's zstd value
        elsewhere = None if stored_raw else bytes(value)
        self.bytes[start: start + self.head] = covered
        if stored_raw:
            self.num_fp16_rows += 1
        else:
            self._decode(row, elsewhere, what)

    def _decode(self, row: int, value: bytes | memoryview, what: str) -> None:
        self.decoder.add(row, value, what)
        self.num_fp16_rows += row not in self.decoder.quant_rows

    def result(self) -> Blocks:
        """fp16 if any row is (quantized rows dequantized into it); a batch of only quantized blocks as QuantBlocks."""
        if not self.num_fp16_rows:
            self.decoder.out = None
        return self.decoder.result()
