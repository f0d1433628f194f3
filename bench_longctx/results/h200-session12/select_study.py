"""Session 12 study: the sketch selection's small launches at 1M tokens (llama3-8b geometry, 64-token blocks):
the two-stage top-k (eviction/topk_kernel.py) with other warp counts, and the fine pass (refine_candidates) over
a wider knob sweep. Graph-replayed, random scores and codes (their time does not depend on the values).
python3 select_study.py OUT.json"""
import json
import math
import sys

import torch
import triton

from bench_longctx.select_bench import graph_us
from bench_longctx.timing import environment
from eviction import topk_kernel as tk
from eviction.sketch_kernel import refine_candidates

H, HQ, D, T, N = 8, 32, 128, 64, 16384
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
out = {"environment": environment(dev), "topk": [], "fine": []}


def two_stage(scores, k, result, chunk_warps, merge_warps, chunk=tk.CHUNK):
    rows, n = scores.shape
    chunks = triton.cdiv(n, chunk)
    cand_key = torch.empty((rows, chunks * k), dtype=torch.int32, device=scores.device)
    cand_idx = torch.empty_like(cand_key)
    tk._chunk_topk_kernel[(chunks, rows)](scores, scores.stride(0), n, k, cand_key, cand_idx, cand_key.stride(0),
                                          CHUNK=chunk, num_warps=chunk_warps)
    block = max(triton.next_power_of_2(chunks * k), 128)
    tk._merge_topk_kernel[(rows,)](cand_key, cand_idx, cand_key.stride(0), chunks * k, k, result, result.stride(0),
                                   result, result, result, result, 0, 0, BLOCK=block, TABLE=False,
                                   num_warps=merge_warps)


scores = torch.rand(H, N, device=dev, generator=g)
for k in (64, 256):
    want = tk.topk_sorted_ref(scores, k)
    base = graph_us(lambda: tk.topk_sorted(scores, k))
    for chunk in (1024, 2048):
        for cw in (4, 8):
            for mw in (4, 8, 16, 32):
                if chunk // 4 < k:
                    continue
                res = torch.empty(H, k, dtype=torch.int64, device=dev)
                run = lambda: two_stage(scores, k, res, cw, mw, chunk)
                run()
                row = {"k": k, "chunk": chunk, "chunk_warps": cw, "merge_warps": mw, "graph_us": graph_us(run),
                       "default_graph_us": base, "equal": bool(torch.equal(res, want))}
                out["topk"].append(row)
                print(json.dumps(row), flush=True)

low = torch.randn(N, H, D, device=dev, generator=g)
summ = torch.stack((low, low + 0.1 + torch.rand(N, H, D, device=dev, generator=g)), 1).half()
codes = torch.randint(0, 256, (N, H, 2, T, D // 4), device=dev, generator=g, dtype=torch.uint8)
q = torch.randn(HQ, D, device=dev, generator=g).half()
cands = torch.sort(torch.randperm(N, device=dev)[:256]).values.repeat(H, 1).contiguous()
z = torch.zeros(HQ, device=dev)
keep = torch.zeros(N, dtype=torch.bool, device=dev)
valid = torch.ones(N, dtype=torch.bool, device=dev)
upper = torch.zeros(HQ, N, device=dev)
for bpp in (1, 2, 4):
    for warps in (1, 2, 4, 8):
        for stages in (1, 2, 3):
            knobs = dict(blocks_per_program=bpp, num_warps=warps, num_stages=stages)
            try:
                run = lambda: refine_candidates(q, summ, codes, cands, z, keep, valid, upper, num_tokens=N * T,
                                                **knobs)
                run()
                row = {**knobs, "graph_us": graph_us(run)}
            except Exception as e:
                row = {**knobs, "error": str(e)[:200]}
            out["fine"].append(row)
            print(json.dumps(row), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
