"""Study (GPU): the 1M norm-matched needles (bench_longctx.sketch_bench) when the sketch's first level reads its
channels in RoPE pairs (p, p + D/2), the pairing a channel-pair code layout would impose (results/selection-quality-cpu-pairs:
it keeps the selection quality on real SmolLM2). The channel kernel reads any channel list, so only the plan changes:
the r / 2 pairs of largest summed importance (sum over the GQA group of |q|), both channels of each.

    python bench_longctx/results/h200-session9/pairs/pair_needles.py OUT [sketch_bench args...]
"""
import sys

import triton
import triton.language as tl

sys.path.insert(0, __file__.rsplit("/bench_longctx/", 1)[0])
import eviction.sketch_channels as sc  # noqa: E402
from bench_longctx import sketch_bench  # noqa: E402


@triton.jit
def _pair_plan_kernel(q_ptr, ch_ptr, stride_qh, stride_ch, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                      HEAD_DIM: tl.constexpr, CHANNELS: tl.constexpr):
    head = tl.program_id(0)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_p = tl.arange(0, HEAD_DIM // 2)
    rows = q_ptr + (head * GROUP + offs_g)[:, None] * stride_qh + offs_p[None, :]
    g_ok = (offs_g < GROUP)[:, None]
    low = tl.load(rows, mask=g_ok, other=0.0).to(tl.float32)
    high = tl.load(rows + HEAD_DIM // 2, mask=g_ok, other=0.0).to(tl.float32)
    importance = tl.sum(tl.abs(low), 0) + tl.sum(tl.abs(high), 0)  # [D / 2]
    ahead = (importance[None, :] > importance[:, None]) | ((importance[None, :] == importance[:, None])
                                                          & (offs_p[None, :] < offs_p[:, None]))
    rank = tl.sum(ahead.to(tl.int32), 1)
    tl.store(ch_ptr + head * stride_ch + rank, offs_p, mask=rank < CHANNELS // 2)
    tl.store(ch_ptr + head * stride_ch + CHANNELS // 2 + rank, offs_p + HEAD_DIM // 2, mask=rank < CHANNELS // 2)


if __name__ == "__main__":
    sc._plan_kernel = _pair_plan_kernel
    raise SystemExit(sketch_bench.main(["--out", sys.argv[1], *sys.argv[2:]]))
