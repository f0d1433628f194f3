"""Session 15: the int8 walk and its neighbours timed in whichever tree is on PYTHONPATH (run alternately in the
session-14 tree and this one): 1M tokens, llama3-8b layer (32 q / 8 kv heads, head_dim 128), block 64, int8_bench's
pools and cases, paged_decode as int8_bench calls it, SDPA over contiguous fp16 KV in the same process.

    int8            warm pool only (issue 10's goal: >= 1.7x SDPA), without and with block mass; splits forced to
                    the planner's 33 (2 programs an SM) and 49 (3 an SM)
    fp16            hot pool only, with mass (the baseline "mixed never slower" is held to)
    first_cooled    all fp16 but the oldest 1/64 of blocks int8, partition walk over a kept partition, with mass

    python walk_time.py OUT_DIR LABEL
"""

from __future__ import annotations

import json
import sys

import torch

from bench_longctx.int8_bench import HEAD_DIM, NUM_Q_HEADS, case_args, make_pools, sdpa_ms
from bench_longctx.timing import environment, time_ms, write_json
from kvstore.attention.paged_decode import paged_decode
from kvstore.attention.partition import partition_table


def main() -> None:
    out_dir, label = sys.argv[1], sys.argv[2]
    device = torch.device("cuda")
    torch.manual_seed(0)
    tokens = 1 << 20
    q = torch.randn((1, NUM_Q_HEADS, HEAD_DIM), dtype=torch.float16, device=device)
    result = {**environment(device), "label": label, "tokens": tokens, "sdpa_ms": sdpa_ms(tokens, q)}
    pools = make_pools(tokens, 64, device)
    args = case_args(pools, "int8", q)
    out, mass = paged_decode(*args, return_block_mass=True)
    result["int8_out_checksum"] = [float(out.float().abs().sum()), float(mass.sum())]
    result["int8_ms"] = time_ms(lambda: paged_decode(*args), device)
    result["int8_mass_ms"] = time_ms(lambda: paged_decode(*args, return_block_mass=True), device)
    for splits in (33, 49, 66):
        result[f"int8_splits{splits}_ms"] = time_ms(lambda: paged_decode(*args, num_splits=splits), device)
    fp16 = case_args(pools, "fp16", q)
    result["fp16_mass_ms"] = time_ms(lambda: paged_decode(*fp16, return_block_mass=True), device)
    cooled = case_args(pools, "first_cooled", q)
    part = partition_table(cooled[5], cooled[6].view(torch.int8), cooled[7], 64)
    result["first_cooled_mass_ms"] = time_ms(
        lambda: paged_decode(*cooled, return_block_mass=True, walk="partition", partition=part), device)
    sinks = case_args(pools, "sinks_recent", q)
    part = partition_table(sinks[5], sinks[6].view(torch.int8), sinks[7], 64)
    result["sinks_recent_mass_ms"] = time_ms(
        lambda: paged_decode(*sinks, return_block_mass=True, walk="partition", partition=part), device)
    result["int8_vs_sdpa"] = result["sdpa_ms"] / result["int8_ms"]
    result["first_cooled_vs_fp16"] = result["fp16_mass_ms"] / result["first_cooled_mass_ms"]
    print(json.dumps(result))
    write_json(out_dir, f"walk_time_{label}.json", result)


if __name__ == "__main__":
    main()
