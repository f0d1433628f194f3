"""Per-row top-k indices, sorted ascending, in one Triton launch (threshold select).

torch.topk + torch.sort over [kv_heads, num_blocks] costs ~80 us at 1M tokens whatever
the block count (several radix passes, each a launch), more than the Quest scan itself.
Here one program per row keeps the whole row in registers, bisects on the order-
preserving integer image of the float scores for the k-th largest value, and compacts
the winners with a prefix sum: indices come out already ascending, ties broken by index.
Rows up to MAX_BLOCKS entries (1M tokens at 16-token blocks); longer rows use torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCKS = 65536
FASTER_THAN_TORCH = 16384  # measured on the H200 (select_bench): beyond this torch.topk + sort wins


@triton.jit
def _threshold_topk_kernel(scores_ptr, s_row, n, k, out_ptr, s_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    valid = offs < n
    x = tl.load(scores_ptr + row * s_row + offs, mask=valid, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)  # NaN ranks lowest
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # monotone: a > b  <=>  key(a) > key(b)
    key = tl.where(valid, key, -2147483647 - 1)  # padding below every real score
    lo = tl.full((), -2147483648, tl.int64)  # invariant: count(key >= lo) >= k
    hi = tl.full((), 2147483647, tl.int64)  # invariant: count(key > hi) < k
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        count = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), axis=0)  # mid stays in int32 range
        lo = tl.where(count >= k, mid, lo)
        hi = tl.where(count >= k, hi, mid - 1)
    t = lo.to(tl.int32)  # the k-th largest key
    above = key > t
    tied = (key == t) & valid
    need = k - tl.sum(above.to(tl.int32), axis=0)
    take = above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= need))
    pos = tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + row * s_out + pos, offs.to(tl.int64), mask=take & valid)


def topk_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [rows, k]: per row the indices of the k largest scores, ascending (ties: lower index wins)."""
    if scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError(f"scores: expected a float [rows, n] tensor, got {scores.dtype} {list(scores.shape)}")
    rows, n = scores.shape
    if not 0 < k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")
    if n > MAX_BLOCKS:
        raise ValueError(f"threshold top-k holds rows of at most {MAX_BLOCKS} in registers, got {n}")
    out = torch.empty((rows, k), dtype=torch.int64, device=scores.device)
    block = max(triton.next_power_of_2(n), 128)
    num_warps = max(4, min(32, block // 1024))
    _threshold_topk_kernel[(rows,)](scores, scores.stride(0), n, k, out, out.stride(0), BLOCK=block,
                                    num_warps=num_warps)
    return out


def topk_sorted_ref(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The same contract in torch: stable descending sort, first k, ascending."""
    order = torch.sort(scores.float().nan_to_num(nan=float("-inf")), dim=1, descending=True, stable=True).indices
    return torch.sort(order[:, :k], dim=1).values
