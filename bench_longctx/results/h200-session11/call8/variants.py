"""Session 11: the CUDA sketch first level's variants, one layer at 1M tokens (llama3-8b: 8 kv heads x 4 q heads,
head_dim 128, 64-token blocks, r = 64), each timed in one process with do_bench, eager (host launch cost included when it exceeds the GPU's) and
replayed from a CUDA graph (the GPU's time; the plan kernel and this one), against Triton's kernel (triton=1): ring depth (STAGES), warps per
program, __launch_bounds__ programs per SM, persistent programs or a warp per tile, channels read in adjacent pairs (pairs=1), and diagnostics that drop parts of the work (wrong results; they locate the time).
Correctness of each non-diagnostic variant: max |diff| vs the torch reference on the first 512 blocks.

    PYTHONPATH=. python bench_longctx/results/h200-session11/variants.py OUT.json
"""

import json
import sys

import torch

from bench_longctx.select_bench import graph_us
from bench_longctx.timing import time_ms
from eviction import sketch_mma
from eviction.sketch_channels import channel_block_stats, channel_block_stats_ref

torch.manual_seed(0)
N, H, G, D, T, R = 16384, 8, 4, 128, 64, 64
dev = torch.device("cuda")
low = torch.randn(N, H, D, device=dev) - 2
summaries = torch.stack((low, low + torch.rand(N, H, D, device=dev) * 3 + 0.1), 1).half()  # [N, 2, H, D]
codes = torch.randint(0, 256, (N, H, 2, T, D // 4), dtype=torch.uint8, device=dev)
q = torch.randn(H * G, D, device=dev).half()
m = 512
refs = {p: channel_block_stats_ref(q, summaries[:m].contiguous(), codes[:m].contiguous(), m * T, R, pairs=p)
        for p in (False, True)}
nbytes = N * H * (4 * D + R * T // 2)
rows = []
base = dict(stages=2, programs=4, persistent=0)
variants = [dict(triton=1), dict(base), dict(base, pairs=1), dict(stages=4, programs=3, persistent=0, pairs=1),
            dict(stages=3, programs=3, persistent=0, pairs=1), dict(base, pairs=1, persistent=1),
            dict(base, pairs=1, DIAG_NO_MATH=1, DIAG_NO_SUMMARY=1, DIAG_NO_EPILOGUE=1, DIAG_NO_STEPS=1)]
for v in variants:
    sketch_mma._DEFINES.clear()
    sketch_mma._DEFINES.update({k: x for k, x in v.items() if k.isupper()})
    sketch_mma._STAGES, sketch_mma._WARPS, sketch_mma._PROGRAMS_PER_SM = v.get("stages", 4), v.get("warps", 4), \
        v.get("programs", 4)
    sketch_mma._PERSISTENT = bool(v.get("persistent", 1))
    sketch_mma._function.cache_clear(), sketch_mma._loads.cache_clear()
    try:
        knobs = dict(blocks_per_program=16) if v.get("triton") else {}
        knobs["pairs"] = bool(v.get("pairs"))
        run = lambda: channel_block_stats(q, summaries, codes, N * T, R, **knobs)
        lse, upper = run()
        us = 1e3 * time_ms(run, dev)
        gus = graph_us(run)
        ref = refs[knobs["pairs"]]
        diff = max(float((lse[:, :m] - ref[0]).abs().max()), float((upper[:, :m] - ref[1]).abs().max()))
        rows.append({"variant": v, "eager_us": round(us, 1), "graph_us": round(gus, 1),
                     "graph_GBps": round(nbytes / gus / 1e3, 1), "max_diff_vs_ref": diff})
    except Exception as e:  # a variant that does not compile or launch is a result
        rows.append({"variant": v, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    print(json.dumps(rows[-1]), flush=True)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "bytes": nbytes}, open(sys.argv[1], "w"), indent=1)
