"""Row views and row copies of block batches (fp16 tensors or QuantBlocks), for host-memory tiers.

A batch's first dimension is its blocks; these helpers treat each field of a batch (the fp16
tensor, or int8 data and both scales) as rows of bytes or 32-bit words.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from tiers.layout import Blocks, QuantBlocks


def fields(blocks: Blocks) -> tuple[torch.Tensor, ...]:
    return blocks.tensors() if isinstance(blocks, QuantBlocks) else (blocks,)


def device_of(blocks: Blocks) -> torch.device:
    return fields(blocks)[0].device


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device`, without a host sync (pinned first) when that is a GPU."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def host_int64(values: Sequence[int]) -> torch.Tensor:
    """int64 [n] on the host, through numpy: torch.tensor of a list of 2,000 ints takes ~4x as long."""
    return torch.from_numpy(np.fromiter(values, dtype=np.int64, count=len(values)))


def normal_device(device: torch.device | str) -> torch.device:
    """cuda -> cuda:<current>, so that devices compare equal however they were named."""
    device = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None \
        else device


def int32_words(t: torch.Tensor) -> torch.Tensor:
    """An int32 [rows, words] view of a block field."""
    return t.view(t.shape[0], -1).view(torch.int32)


def row_runs(src_rows: torch.Tensor, dst_rows: torch.Tensor) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of each run of positions whose rows are consecutive on both sides, in order
    (host int64 rows)."""
    s, d = src_rows.numpy(), dst_rows.numpy()
    n = len(s)
    if n == 0:
        return []
    starts = np.concatenate(([0], np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1))
    lengths = np.diff(np.concatenate((starts, [n])))
    return list(zip(s[starts].tolist(), d[starts].tolist(), lengths.tolist()))


def copy_rows(src: Blocks, src_rows: torch.Tensor, dst: Blocks, dst_rows: torch.Tensor) -> None:
    """dst[dst_rows] = src[src_rows] for either block format, on the host. Row copies through numpy (torch's
    5-D indexing on CPU is ~50x slower and its thread pool stalls when cores are contended): one slice copy per
    run of rows consecutive on both sides, no temporary (a fancy-indexed gather would allocate and fault in a
    batch-sized buffer first); scattered rows (runs shorter than 8 on average) go by fancy indexing."""
    runs = row_runs(src_rows, dst_rows)
    scattered = len(runs) > len(src_rows) // 8
    for d, s in zip(fields(dst), fields(src)):
        d2, s2 = byte_rows(d), byte_rows(s)
        if scattered:
            d2[dst_rows.numpy()] = s2[src_rows.numpy()]
            continue
        for s0, d0, n in runs:
            d2[d0: d0 + n] = s2[s0: s0 + n]


def copy_row_runs(src: Blocks, src_rows: torch.Tensor, dst: Blocks, dst_rows: torch.Tensor) -> None:
    """dst[dst_rows] = src[src_rows] with one copy per run of rows consecutive on both sides, for a source on
    any device and a host destination: from a GPU into pinned rows each run is one DMA, queued (non_blocking;
    the caller synchronizes before the host reads the rows). Rows as host int64 tensors."""
    for s0, d0, n in row_runs(src_rows, dst_rows):
        for df, sf in zip(fields(dst), fields(src)):
            df[d0: d0 + n].copy_(sf[s0: s0 + n], non_blocking=True)


def byte_rows(t: torch.Tensor):
    """A [rows, bytes] uint8 numpy view of a CPU tensor."""
    return t.view(t.shape[0], -1).view(torch.uint8).numpy()


def row_slice(blocks: Blocks, lo: int, hi: int) -> Blocks:
    return blocks.index(slice(lo, hi)) if isinstance(blocks, QuantBlocks) else blocks[lo:hi]
