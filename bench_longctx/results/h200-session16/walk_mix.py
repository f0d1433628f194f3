"""Session 16: the partition walk over every int8_bench mix, timed in whichever tree is on PYTHONPATH (run
alternately in the session-15 tree and this one): 1M tokens, llama3-8b layer (32 q / 8 kv heads, head_dim 128),
block 64, int8_bench's pools, a random block table, SDPA over contiguous fp16 KV in the same process.

    int8            warm pool only (issue 10: >= 1.7x SDPA), no mass
    fp16            hot pool only, with mass: what "mixed never slower than fp16" is held to
    <mix>           both pools present, partition walk over a kept partition (what the decode step runs), with
                    mass: first_cooled (1/64 int8), sinks_recent (~99% int8), alternate (1/2), int8+hot (all int8)

    python walk_mix.py OUT_DIR LABEL
"""

from __future__ import annotations

import json
import sys

import torch

from bench_longctx.int8_bench import HEAD_DIM, NUM_Q_HEADS, case_args, make_pools, sdpa_ms
from bench_longctx.timing import environment, time_ms, write_json
from kvstore.attention.paged_decode import paged_decode
from kvstore.attention.partition import partition_table

MIXES = ("first_cooled", "sinks_recent", "alternate", "int8+hot")


def main() -> None:
    out_dir, label = sys.argv[1], sys.argv[2]
    device = torch.device("cuda")
    torch.manual_seed(0)
    tokens = 1 << 20
    q = torch.randn((1, NUM_Q_HEADS, HEAD_DIM), dtype=torch.float16, device=device)
    result = {**environment(device), "label": label, "tokens": tokens, "sdpa_ms": sdpa_ms(tokens, q)}
    pools = make_pools(tokens, 64, device)
    int8 = case_args(pools, "int8", q)
    result["int8_ms"] = time_ms(lambda: paged_decode(*int8), device)
    fp16 = case_args(pools, "fp16", q)
    result["fp16_mass_ms"] = time_ms(lambda: paged_decode(*fp16, return_block_mass=True), device)
    ref_out, ref_mass = paged_decode(*fp16, return_block_mass=True)
    for mix in MIXES:
        args = case_args(pools, mix, q)
        part = partition_table(args[5], args[6].view(torch.int8), args[7], 64)
        out, mass = paged_decode(*args, return_block_mass=True, walk="partition", partition=part)
        result[f"{mix}_mass_sum"] = float(mass.sum())  # 8.0: each kv head's mass sums to 1
        result[f"{mix}_mass_ms"] = time_ms(
            lambda: paged_decode(*args, return_block_mass=True, walk="partition", partition=part), device)
        result[f"{mix}_vs_fp16"] = result["fp16_mass_ms"] / result[f"{mix}_mass_ms"]
    result["fp16_out_checksum"] = [float(ref_out.float().abs().sum()), float(ref_mass.sum())]
    result["int8_vs_sdpa"] = result["sdpa_ms"] / result["int8_ms"]
    print(json.dumps(result))
    write_json(out_dir, f"walk_mix_{label}.json", result)


if __name__ == "__main__":
    main()
