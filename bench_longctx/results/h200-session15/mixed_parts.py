"""Session 15 (planned in session 14): where a nearly all-fp16 mixed table loses its 1.5% to
fp16 alone (int8_bench's first_cooled: 0.994 vs 0.979 ms at 1M, block 64, with mass; all fp16 with the warm pool
present 0.996). Each case replayed from a CUDA graph (as the decode step runs it) under torch.profiler; per kernel
(the fp16 split launch, the int8 launch, the partition's, the merge): launches and GPU microseconds per call.

    python bench_longctx/results/h200-session15/mixed_parts.py OUT_DIR
"""

from __future__ import annotations

import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from bench_longctx.int8_bench import HEAD_DIM, NUM_Q_HEADS, case_args, make_pools
from bench_longctx.step_profile import kernel_table
from bench_longctx.timing import environment, time_ms, write_json
from kvstore.attention.paged_decode import paged_decode
from kvstore.attention.partition import partition_table

CALLS = 50
CASES = {  # label: (int8_bench case, kept partition)
    "fp16_alone": ("fp16", False), "fp16_with_warm_pool": ("fp16+warm", True),
    "first_cooled": ("first_cooled", True), "first_cooled_partitioned_in_call": ("first_cooled", False),
    "sinks_recent": ("sinks_recent", True), "int8_alone": ("int8", False),
}


def main() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    q = torch.randn((1, NUM_Q_HEADS, HEAD_DIM), dtype=torch.float16, device=device)
    pools = make_pools(1 << 20, 64, device)
    result = {**environment(device), "calls": CALLS, "cases": {}}
    for label, (case, kept) in CASES.items():
        args = case_args(pools, case, q)
        kwargs = {"return_block_mass": True}
        if case not in ("fp16", "int8"):
            kwargs["walk"] = "partition"
        if kept:
            kwargs["partition"] = partition_table(args[5], args[6].view(torch.int8), args[7], 64)
        paged_decode(*args, **kwargs)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            paged_decode(*args, **kwargs)
        ms = time_ms(graph.replay, device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(CALLS):
                graph.replay()
            torch.cuda.synchronize()
        result["cases"][label] = {"graph_ms": ms, "kernels": kernel_table(prof, CALLS)}
        print(label, json.dumps(result["cases"][label], indent=1))
    write_json(sys.argv[1], "mixed_parts.json", result)


if __name__ == "__main__":
    main()
