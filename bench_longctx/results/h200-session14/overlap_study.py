"""Session 14: the partition walk's two launches (fp16 entries, int8 entries) one after the other on one stream, or
forked onto two streams and joined before the merge (paged_decode.OVERLAP_POOLS), at 1M tokens, block 64, with H2O
mass, over a kept partition (as the decode step runs it), per int8_bench table; outputs compared bit for bit; and
the same forked walk replayed from a CUDA graph against its eager result.

    python bench_longctx/results/h200-session14/overlap_study.py OUT_DIR
"""

from __future__ import annotations

import json
import sys

import torch

from bench_longctx.int8_bench import HEAD_DIM, NUM_Q_HEADS, case_args, make_pools, sdpa_ms
from bench_longctx.timing import environment, time_ms, write_json
from kvstore.attention import paged_decode as module
from kvstore.attention.partition import partition_table

CASES = ("sinks_recent", "first_cooled", "int8+hot", "alternate", "fp16+warm")


def main() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    q = torch.randn((1, NUM_Q_HEADS, HEAD_DIM), dtype=torch.float16, device=device)
    result = {**environment(device), "sdpa_ms": sdpa_ms(1 << 20, q), "rows": []}
    pools = make_pools(1 << 20, 64, device)
    fp16 = case_args(pools, "fp16", q)
    result["fp16_alone_mass_ms"] = time_ms(lambda: module.paged_decode(*fp16, return_block_mass=True), device)
    for case in CASES:
        args = case_args(pools, case, q)
        part = partition_table(args[5], args[6].view(torch.int8), args[7], 64)
        row = {"case": case}
        outs = {}
        for overlap in (False, True, False, True):
            module.OVERLAP_POOLS = overlap
            call = lambda: module.paged_decode(*args, return_block_mass=True, walk="partition", partition=part)  # noqa: E731
            outs[overlap] = call()
            row.setdefault(f"overlap_{overlap}_ms", []).append(time_ms(call, device))
        row["equal"] = all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))
        module.OVERLAP_POOLS = True
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = module.paged_decode(*args, return_block_mass=True, walk="partition", partition=part)
        graph.replay()
        torch.cuda.synchronize()
        row["graph_equal"] = all(torch.equal(a, b) for a, b in zip(captured, outs[True]))
        row["graph_ms"] = time_ms(graph.replay, device)
        print(json.dumps(row))
        result["rows"].append(row)
    write_json(sys.argv[1], "overlap_study.json", result)


if __name__ == "__main__":
    main()
