"""Session 7 diagnosis: the split kernel's int8 (warm-only) and fp16 (hot-only) loops at 1M tokens, 64-token
blocks, over tile (blocks per iteration), warps, pipeline stages (1-6) and split counts, against SDPA and the copy
ceiling in the same run. Hypothesis (offline ttgir, session 7): each iteration waits for its own loads, so a
program keeps (stages - 1) tiles in flight, and int8's tiles are half fp16's at the same occupancy.
    python bench_longctx/results/h200-session7/diag_int8_sweep.py OUT.json"""
import itertools, json, sys, time
import torch
sys.path.insert(0, ".")
from bench_longctx.int8_bench import HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS, bytes_needed, case_args, make_pools, sdpa_ms
from bench_longctx.timing import copy_ceiling_GBps, time_ms
from kvstore.attention.paged_decode import paged_decode

dev = torch.device("cuda")
torch.manual_seed(0)
ceiling = copy_ceiling_GBps(dev)
q = torch.randn((1, NUM_Q_HEADS, HEAD_DIM), dtype=torch.float16, device=dev)
sdpa = sdpa_ms(1 << 20, q)
pools = make_pools(1 << 20, 64, dev)
rows = []
ref = {}
for case in ("int8", "fp16"):
    args = case_args(pools, case, q)
    out, mass = paged_decode(*args, return_block_mass=True)
    ref[case] = (out, mass)
    ms = time_ms(lambda: paged_decode(*args, return_block_mass=True), dev)
    rows.append(dict(case=case, config="default", ms=ms))
    print(case, "default", round(ms, 4), flush=True)
start = time.time()
grid = [(1, 2), (1, 4), (2, 4), (2, 8)]
for (bpi, warps), stages in itertools.product(grid, (1, 2, 3, 4, 5, 6)):
    for case in ("int8", "fp16"):
        if case == "fp16" and (stages > 4 or warps == 2):
            continue
        args = case_args(pools, case, q)
        for splits in (17, 33, 50, 66, 100, 132):
            kw = dict(blocks_per_iter=bpi, num_warps=warps, num_stages=stages, num_splits=splits)
            try:
                out, mass = paged_decode(*args, return_block_mass=True, **kw)
                ok = bool(torch.allclose(out.float(), ref[case][0].float(), atol=2e-3) and
                          torch.allclose(mass, ref[case][1], atol=1e-4))
                ms = time_ms(lambda: paged_decode(*args, return_block_mass=True, **kw), dev)
            except Exception as e:  # out of shared memory / registers
                rows.append(dict(case=case, **kw, error=f"{type(e).__name__}: {e}"[:200]))
                print(case, kw, "error", type(e).__name__, flush=True)
                break
            rows.append(dict(case=case, **kw, ms=ms, ok=ok))
            print(case, kw, round(ms, 4), ok, flush=True)
for r in rows:
    if "ms" in r:
        r["GBps"] = bytes_needed(pools, r["case"]) / r["ms"] / 1e6
        r["of_ceiling"] = r["GBps"] / ceiling
        r["speed_vs_sdpa"] = sdpa / r["ms"]
best = {c: min((r for r in rows if r["case"] == c and "ms" in r), key=lambda r: r["ms"]) for c in ("int8", "fp16")}
print("best", json.dumps(best, indent=1))
json.dump(dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               torch=torch.__version__, copy_ceiling_GBps=ceiling, sdpa_1M_ms=sdpa, rows=rows, best=best,
               sweep_s=time.time() - start), open(sys.argv[1], "w"), indent=1)
