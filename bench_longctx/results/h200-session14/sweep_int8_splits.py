"""Session 14: the CUDA int8 walk (warm pool only, 1M tokens, block 64, llama3-8b layer) timed over its grid: splits
per kv head (plan.py picks 33: 2 programs an SM, where the kernel's launch bounds allow 3) and blocks per iteration;
SDPA in the same run. Each forced config's output is checked against the default's.

    python bench_longctx/results/h200-session14/sweep_int8_splits.py OUT_DIR
"""

from __future__ import annotations

import json
import sys

import torch

from bench_longctx.int8_bench import HEAD_DIM, NUM_Q_HEADS, case_args, make_pools, sdpa_ms
from bench_longctx.timing import environment, time_ms, write_json
from kvstore.attention.paged_decode import paged_decode

SPLITS = (16, 24, 33, 40, 49, 50, 66, 82, 99, 132, 165, 198, 264, 396)


def main() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    q = torch.randn((1, NUM_Q_HEADS, HEAD_DIM), dtype=torch.float16, device=device)
    sdpa = sdpa_ms(1 << 20, q)
    pools = make_pools(1 << 20, 64, device)
    args = case_args(pools, "int8", q)
    want, _ = paged_decode(*args)
    rows = [{"config": "default", "ms": time_ms(lambda: paged_decode(*args), device)}]
    for bpi in (1, 2):
        for splits in SPLITS:
            got, _ = paged_decode(*args, num_splits=splits, blocks_per_iter=bpi)
            err = float((got.float() - want.float()).abs().max())
            ms = time_ms(lambda: paged_decode(*args, num_splits=splits, blocks_per_iter=bpi), device)
            rows.append({"blocks_per_iter": bpi, "splits": splits, "ms": ms, "max_abs_diff": err})
    for r in rows:
        r["vs_sdpa"] = sdpa / r["ms"]
        print(json.dumps(r))
    write_json(sys.argv[1], "sweep_int8_splits.json", {**environment(device), "sdpa_ms": sdpa, "rows": rows})


if __name__ == "__main__":
    main()
