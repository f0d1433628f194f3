"""Session 12 study: the CUDA first level (eviction/sketch_mma.cu) over two physical layouts of the same codes.

  block-major    the store's layout: uint8 [N, H, D, T/2], a block's channel rows back to back (32-byte rows
                 chosen among D per block: the gather DRAM serves in 64-byte pieces)
  channel-major  uint8 [H, D, N, T/2] seen as the same [N, H, D, T/2] by strides: channel d of consecutive
                 blocks is contiguous, so a warp's 16-block tile reads each chosen channel as one 512-byte run

Same bytes, same kernel (only the code strides differ): outputs must be identical. Graph-replayed times at 1M
tokens, llama3-8b geometry, r in {32, 64}. Then (call 5) the block-major layout with the read channels in rank order
(the plan's) against ascending channel order: a warp's copy instruction then touches adjacent rows of the same
128-byte lines. Then (call 7) channel-major codes with a ring stage of SB = 1, 2, 4 blocks (sketch_mma._STAGE_BLOCKS:
each read channel's SB rows copied as one run). python3 layout_study.py OUT.json

Runs at the trees its calls record (callN/REV): the launcher's code_strides argument and _STAGE_BLOCKS were measured
here and removed after call 7 (neither layout nor stage size beat the ascending plan over the store's layout).
"""
import json
import math
import sys

import torch

from bench_longctx.select_bench import graph_us
from bench_longctx.timing import copy_ceiling_GBps, environment
from eviction import sketch_mma

N, H, HQ, D, T = 16384, 8, 32, 128, 64
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
low = torch.randn(N, H, D, device=dev, generator=g)
summ = torch.stack((low, low + 0.1 + torch.rand(N, H, D, device=dev, generator=g)), 1).half()  # [N, 2, H, D]
rows = torch.randint(0, 256, (N, H, D, T // 2), device=dev, generator=g, dtype=torch.uint8)
codes5 = rows.view(N, H, 2, T, D // 4)
phys = rows.permute(1, 2, 0, 3).contiguous()  # [H, D, N, T/2]
fake5 = torch.as_strided(phys, (N, H, 2, T, D // 4), (T // 2, D * N * T // 2, 0, 0, 0))  # ptr + shape[3] only
q = torch.randn(HQ, D, device=dev, generator=g).half()
out = {"environment": environment(dev), "tokens": N * T, "copy_ceiling_GBps": copy_ceiling_GBps(dev), "rows": []}
for r in (32, 64):
    imp = q.float().view(H, HQ // H, D).abs().sum(1)
    channels = imp.argsort(dim=1, descending=True, stable=True)[:, :r].int().contiguous()
    res = {}
    for name, codes, strides in (("block_major", codes5, None),
                                 ("channel_major", fake5, (T // 2, D * N * T // 2, N * T // 2))):
        lse = torch.empty(HQ, N, device=dev)
        upper = torch.empty_like(lse)
        run = lambda: sketch_mma.launch(q, summ, codes, channels, None, lse, upper, N * T, 1 / math.sqrt(D),
                                        code_strides=strides)
        run()
        torch.cuda.synchronize()
        res[name] = (lse.clone(), upper.clone(), graph_us(run))
    nbytes = summ.numel() * 2 + N * H * r * T // 2
    row = {"r": r, "MiB": nbytes / 2**20,
           "identical": bool(torch.equal(res["block_major"][0], res["channel_major"][0])
                             and torch.equal(res["block_major"][1], res["channel_major"][1])),
           **{f"{k}_graph_us": v[2] for k, v in res.items()},
           **{f"{k}_GBps": nbytes / v[2] / 1e3 for k, v in res.items()}}
    for order in ("rank", "ascending"):
        chans = channels if order == "rank" else channels.sort(dim=1).values.contiguous()
        lse = torch.empty(HQ, N, device=dev)
        upper = torch.empty_like(lse)
        run = lambda: sketch_mma.launch(q, summ, codes5, chans, None, lse, upper, N * T, 1 / math.sqrt(D))
        run()
        torch.cuda.synchronize()
        row[f"block_major_{order}_graph_us"] = graph_us(run)
        row[f"block_major_{order}_lse_max_diff"] = float((lse - res["block_major"][0]).abs().max())
        row[f"block_major_{order}_upper_max_diff"] = float((upper - res["block_major"][1]).abs().max())
        asc = (lse.clone(), upper.clone())
    # call 7: channel-major codes copied SB blocks a stage (each read channel's SB rows one run), channels ascending
    chans = channels.sort(dim=1).values.contiguous()
    for sb in (1, 2, 4):
        sketch_mma._STAGE_BLOCKS = sb
        lse = torch.empty(HQ, N, device=dev)
        upper = torch.empty_like(lse)
        run = lambda: sketch_mma.launch(q, summ, fake5, chans, None, lse, upper, N * T, 1 / math.sqrt(D),
                                        code_strides=(T // 2, D * N * T // 2, N * T // 2))
        run()
        torch.cuda.synchronize()
        row[f"channel_major_ascending_sb{sb}_graph_us"] = graph_us(run)
        row[f"channel_major_ascending_sb{sb}_max_diff"] = max(float((lse - res["block_major"][0]).abs().max()),
                                                              float((upper - res["block_major"][1]).abs().max()))
        row[f"channel_major_ascending_sb{sb}_equal_to_block_major_ascending"] = bool(
            torch.equal(lse, asc[0]) and torch.equal(upper, asc[1]))
    out["rows"].append(row)
    print(json.dumps(row), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
