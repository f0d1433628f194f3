"""The paged decode attention kernel the store's decode path runs.

    paged_decode.py  the entry of every walk: checks, picks the walk (plan.py), merges (merge.py)
    split_walk.py    long tables: Triton split-K (flash-decoding) over fp16 (hot) and warm blocks, GQA
    one_tile.py      short tables (a top-k budget): one program per tile, each in its own pool's format, one launch
    tiles.py         one tile of K/V: table entries -> slots, fp16 rows, warm rows dequantized in registers
    partition.py     a mixed long table reordered per row on the device, fp16 entries then int8 ones (one launch each)
    int8_mma.cu/.py  the split walk's int8 launches as a CUDA kernel (NVRTC at run time): bytes decoded straight into
                     tensor-core operand registers; Triton's loop where it cannot run (CPU, no NVRTC, other shapes)
    merge.py         merges the splits, turns per-block log-sums into attention mass for H2O, and can return
                     each q head's log-sum-exp (one launch)
    append.py        the decode token into its tail slot and block summary: a launch of its own, or inside the
                     one-tile launch (paged_decode(append=NewToken(...)))
    plan.py          input checks and the launch configuration per geometry (which walk, tiles, splits)
    reference.py     the pure-torch references with the same contracts (what CPU runs)
"""

from __future__ import annotations

from typing import Callable

import torch


def kernel_for(device: torch.device) -> Callable:
    """The Triton kernel on CUDA; on CPU its torch reference (same contract). The Triton
    interpreter is for tests, far too slow to serve."""
    if device.type == "cuda":
        from kvstore.attention.paged_decode import paged_decode

        return paged_decode
    from kvstore.attention.reference import paged_decode_ref

    return paged_decode_ref
