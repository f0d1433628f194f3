"""Session 7 diagnosis after call 3: which int8 loop tile and split count serve each walk. At 1M tokens, block
sizes 32 and 64, with block mass (as the decode step asks): the direct walk over the warm pool only, and the
partition walk (fp16 launch + int8 launch) over sinks_recent and alternate tables, for int8 loops of 64 and
128 tokens per iteration at 33 and 66 splits (fp16 loop fixed: 128 tokens, 33 splits); the fused walk (one
launch, both loops at the fp16 config) as the control. Outputs checked against the default config.
    python bench_longctx/results/h200-session7/diag_pool_loops.py OUT.json"""
import itertools, json, sys, time
import torch
sys.path.insert(0, ".")
from bench_longctx.int8_bench import HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS, bytes_needed, case_args, make_pools, sdpa_ms
from bench_longctx.timing import copy_ceiling_GBps, time_ms
from kvstore.attention import paged_decode as pd
from kvstore.attention.merge import merge_splits
from kvstore.attention.plan import DecodeGeometry, decode_config

dev = torch.device("cuda")
torch.manual_seed(0)
ceiling = copy_ceiling_GBps(dev)
q = torch.randn((1, NUM_Q_HEADS, HEAD_DIM), dtype=torch.float16, device=dev)
sdpa = sdpa_ms(1 << 20, q)
rows = []


def run(args, geom, loops, walk):
    q_, hot, warm, ks, vs, table, flags, n = args
    flags = flags.view(torch.int8)
    scale = HEAD_DIM ** -0.5 * pd.LOG2E
    parts = pd.split_partials(q_, hot, warm.view(torch.int32), ks, vs, table, flags, n, geom, loops, scale, True, walk)
    return merge_splits(*parts, n, geom, True, None)


for bt in (64, 32):
    pools = make_pools(1 << 20, bt, dev)
    geom = DecodeGeometry(1, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, bt, pools["n"])
    fp16 = decode_config(geom, dev, one_tile=False, blocks_per_iter=128 // bt, num_splits=33)
    for case in ("int8", "sinks_recent", "alternate"):
        args = case_args(pools, case, q)
        ref_out, ref_mass = pd.paged_decode(*args, return_block_mass=True, walk="fused")
        variants = [("fused", {"fp16": fp16, "int8": fp16}, "fused")] if case != "int8" else []
        for tokens, splits in itertools.product((64, 128), (33, 66)):
            i8 = decode_config(geom, dev, one_tile=False, blocks_per_iter=tokens // bt, num_splits=splits)
            variants.append((f"int8_t{tokens}_s{splits}", {"fp16": fp16, "int8": i8}, "partition"))
        for label, loops, walk in variants:
            out, mass = run(args, geom, loops, walk)
            ok = bool(torch.allclose(out.float(), ref_out.float(), atol=2e-3) and torch.allclose(mass, ref_mass, atol=1e-4))
            ms = time_ms(lambda: run(args, geom, loops, walk), dev)
            gbps = bytes_needed(pools, case) / ms / 1e6
            rows.append(dict(block_tokens=bt, case=case, variant=label, walk=walk, ms=ms, ok=ok, GBps=gbps,
                             of_ceiling=gbps / ceiling, speed_vs_sdpa=sdpa / ms))
            print(bt, case, label, round(ms, 4), ok, round(sdpa / ms, 2), flush=True)
    del pools
    torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               copy_ceiling_GBps=ceiling, sdpa_1M_ms=sdpa, rows=rows), open(sys.argv[1], "w"), indent=1)
