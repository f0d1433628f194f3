"""Blocks of a tier that holds several formats (ssd, saved), read in the format each is stored in.

`decode_as_stored` verifies stored values (tiers/codec.py: every block's header and xxh3) and copies each
payload once into one host buffer laid out as

    fp16 batch [nf, 2, H, B, D] | data, k_scale, v_scale of nq quantized blocks of one format

(tiers/layout.py has their shapes; that format is the layout's warm_format where any value has it, else the
first quantized value's: values in yet another format, written by stores of other warm formats, are
dequantized into the fp16 rows)

(pinned when the blocks go to a GPU), which reaches the device in one copy. Callers hand it the values
where they lie (LMDB: views of the mapped pages), so a block's bytes are copied once on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from tiers.base import device_ints
from tiers.codec import Codec
from tiers.errors import IntegrityError
from tiers.layout import FORMAT_CODES, BlockLayout, QuantBlocks
from tiers.quant import dequantize

_ALIGN = 256  # each section starts aligned, as a fresh allocation does (kernels specialise on 16-byte pointers)


@dataclass(slots=True)
class StoredBlocks:
    """Blocks gathered in the format each is stored in; fp16_at / quant_at are positions in the ids asked for."""

    fp16_at: list[int]
    fp16: torch.Tensor  # [len(fp16_at), 2, H, B, D]
    quant_at: list[int]
    quant: QuantBlocks  # len(quant_at) blocks, in the warm tier's format

    def parts(self) -> list[tuple[list[int], torch.Tensor | QuantBlocks]]:
        """(positions, blocks) of each format present, the quantized ones first."""
        return [(at, blocks) for at, blocks in ((self.quant_at, self.quant), (self.fp16_at, self.fp16)) if at]

    def one_format(self) -> torch.Tensor | QuantBlocks:
        """All blocks in order in one batch: quantized when all are, else fp16 (quantized ones dequantized)."""
        if not self.fp16_at and self.quant_at:
            return self.quant
        if not self.quant_at:
            return self.fp16
        out = torch.empty((len(self.fp16_at) + len(self.quant_at), *self.fp16.shape[1:]), dtype=torch.float16,
                          device=self.fp16.device)  # [n, 2, H, B, D]
        out[device_ints(self.fp16_at, out.device)] = self.fp16
        out[device_ints(self.quant_at, out.device)] = dequantize(self.quant)
        return out


@runtime_checkable
class MixedFormatTier(Protocol):
    """A tier that holds blocks of both formats and hands each back in its own (ssd, saved): kvstore/decode/staging.py
    stages such blocks in the format they were stored in."""

    def fetch_as_stored(self, ids: Sequence[int], device: torch.device | str) -> StoredBlocks: ...


def decode_tier_values(tier, codec: Codec, ids: Sequence[int], values: Sequence, what: str,
                       device: torch.device | str, missing: Callable[[list[int]], Exception]) -> StoredBlocks:
    """decode_as_stored of the values a tier read for `ids`: raises missing(the first ids whose value is gone),
    and counts a damaged batch in tier.integrity_errors before re-raising."""
    gone = [i for i, v in zip(ids, values) if v is None]
    if gone:
        raise missing(gone[:8])
    try:
        return decode_as_stored(codec, tier.layout, ids, values, what, device)
    except IntegrityError:
        tier.integrity_errors += 1
        raise


def decode_as_stored(codec: Codec, layout: BlockLayout, ids: Sequence[int], values: Sequence[bytes | memoryview],
                     what: str, device: torch.device | str) -> StoredBlocks:
    """Stored values of blocks `ids` -> the blocks on `device`, each in its stored format. Raises IntegrityError
    (naming f"{what} block {id}") on any damage, before anything is copied."""
    checked = [codec.verify(layout, v, f"{what} block {i}") for i, v in zip(ids, values)]  # (format, payload)
    quantized = [fmt for fmt, _ in checked if fmt != 0]
    warm = FORMAT_CODES[layout.warm_format]
    kept = warm if warm in quantized or not quantized else quantized[0]
    quant_at = [r for r, (fmt, _) in enumerate(checked) if fmt == kept]
    fp16_at = [r for r, (fmt, _) in enumerate(checked) if fmt != kept]  # fp16, or another format dequantized
    specs = layout.field_specs(next(name for name, code in FORMAT_CODES.items() if code == kept))
    rows = [len(fp16_at)] + [len(quant_at)] * 3
    row_bytes = [layout.fp16_bytes] + [int(np.prod(shape)) * dtype.itemsize for shape, dtype in specs]
    sizes = [n * size for n, size in zip(rows, row_bytes)]
    starts = [sum(-(-s // _ALIGN) * _ALIGN for s in sizes[:i]) for i in range(4)]
    device = torch.device(device)
    # pinned wherever CUDA is (also for a host batch): torch caches pinned buffers, so a load's batch after batch
    # reuses memory instead of faulting in fresh pages, and the cpu tier's copy of the batch to the GPU for its
    # sums is a DMA (BENCHMARKS.md, Save and load against the disk)
    host = torch.empty(starts[-1] + sizes[-1], dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    sections = [host.numpy()[o: o + s].reshape(n, size) for o, s, n, size in zip(starts, sizes, rows, row_bytes)]
    for row, r in enumerate(fp16_at):
        fmt, payload = checked[r]
        sections[0][row] = np.frombuffer(payload if fmt == 0 else _fp16_bytes(codec, layout, values[r], what), np.uint8)
    k_at, v_at = row_bytes[1], row_bytes[1] + row_bytes[2]
    for row, r in enumerate(quant_at):
        payload = np.frombuffer(checked[r][1], np.uint8)
        sections[1][row], sections[2][row], sections[3][row] = payload[:k_at], payload[k_at:v_at], payload[v_at:]
    buffer = host if device.type == "cpu" else host.to(device, non_blocking=True)  # pinned: the copy is queued

    def section(i: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return buffer[starts[i]: starts[i] + sizes[i]].view(dtype).view(shape)

    quant = QuantBlocks(*(section(i + 1, dtype, (rows[1], *shape)) for i, (shape, dtype) in enumerate(specs)))
    return StoredBlocks(fp16_at, section(0, torch.float16, (rows[0], *layout.shape)), quant_at, quant)


def _fp16_bytes(codec: Codec, layout: BlockLayout, value: bytes | memoryview, what: str) -> np.ndarray:
    """The fp16 bytes of a verified value in a quantized format other than the layout's warm one."""
    return dequantize(codec.decode(layout, value, what)).view(torch.uint8).numpy().reshape(-1)
