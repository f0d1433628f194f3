"""Sketch top-K selection at 1M tokens: its passes, their bytes, against Quest and the copy ceiling (one run).

    python -m bench_longctx.sketch_bench --out DIR [--tokens 1048576] [--budget 4096] [--blocks 32,64]

Llama-3-8B attention geometry (32 q / 8 kv heads, head_dim 128), one layer; keys drawn from
SmolLM2's key distribution (bench_longctx/needle.py). Per block size: the coarse pass (high
plane of every block), the fine pass (both planes of coarse_factor x k candidates), the whole
SketchTopK selection as the captured decode step runs it (select_masked, eager and replayed from
a CUDA graph), and Quest's fused selection; bytes each pass reads and the time they would take at
the device-to-device copy ceiling measured in the same run. Bytes per token and kv head of the
sketch vs the fp16 K+V it describes. CUDA only (the kernels are far too slow interpreted).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from bench_longctx.needle import background, key_distribution
from bench_longctx.select_bench import graph_us
from bench_longctx.timing import copy_ceiling_GBps, environment, time_ms
from eviction.select import protected_mask
from eviction.sketch import sketch_keys
from eviction.sketch_kernel import sketch_block_stats
from eviction.sketch_topk import SketchTopK
from eviction.topk import topk_select
from kvstore.config import ModelSpec

SPEC = ModelSpec.preset("llama3-8b", num_layers=1)


def bench_block_size(args, block_tokens: int, q: torch.Tensor, keys: torch.Tensor, ceiling: float) -> dict:
    summaries, codes = sketch_keys(keys, block_tokens)
    n, h, d = summaries.shape[0], SPEC.num_kv_heads, SPEC.head_dim
    k = args.budget // block_tokens
    policy = SketchTopK(coarse_factor=args.coarse_factor)
    candidates = torch.randint(0, n, (h, policy.coarse_factor * k), device=q.device)
    protected = protected_mask(num_tokens=keys.shape[0], block_tokens=block_tokens, sink_tokens=64,
                               recent_tokens=1024, device=q.device)
    valid = torch.ones(n, dtype=torch.bool, device=q.device)
    summary_bytes = n * h * 2 * d * 2
    plane_bytes = n * h * block_tokens * d // 4
    row = {"block_tokens": block_tokens, "num_blocks": n,
           "sketch_bytes_per_token_per_kv_head": 2 * d // 4 + 2 * d * 2 / block_tokens,
           "kv_fp16_bytes_per_token_per_kv_head": 2 * d * 2,
           "coarse_MiB": (summary_bytes + plane_bytes) / 2**20,
           "fine_MiB": policy.coarse_factor * k * h * (2 * d * 2 + 2 * block_tokens * d // 4) / 2**20}
    row["coarse_ceiling_us"] = (summary_bytes + plane_bytes) / ceiling / 1e3
    for warps in (1, 2, 4, 8):  # the kernel's one tuning knob
        row[f"coarse_us_warps{warps}"] = 1e3 * time_ms(
            lambda w=warps: sketch_block_stats(q, summaries, codes, keys.shape[0], planes=1, num_warps=w), q.device)
    row["coarse_us"] = min(row[f"coarse_us_warps{w}"] for w in (1, 2, 4, 8))
    row["coarse_GBps"] = (summary_bytes + plane_bytes) / row["coarse_us"] / 1e3
    row["fine_us"] = 1e3 * time_ms(lambda: sketch_block_stats(q, summaries, codes, keys.shape[0], planes=2,
                                                              block_ids=candidates), q.device)
    full_scan = lambda: sketch_block_stats(q, summaries, codes, keys.shape[0], planes=2)  # noqa: E731
    row["full_4bit_scan_us"] = 1e3 * time_ms(full_scan, q.device)
    select = lambda: policy.select_masked(q, summaries, codes, valid, protected, k)  # noqa: E731
    row["sketch_select_us"] = 1e3 * time_ms(select, q.device)
    row["sketch_select_graph_us"] = graph_us(select)
    quest = lambda: topk_select(q, summaries, num_tokens=keys.shape[0], block_tokens=block_tokens,  # noqa: E731
                                budget_tokens=args.budget, sink_tokens=64, recent_tokens=1024)
    row["quest_select_graph_us"] = graph_us(quest)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--blocks", default="32,64")
    parser.add_argument("--coarse-factor", type=int, default=SketchTopK.coarse_factor)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("sketch_bench needs CUDA")
        return 2
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    mean, chol = key_distribution(SPEC, 15, dev)
    keys = torch.cat([background(min(1 << 16, args.tokens - s), mean, chol, g)
                      for s in range(0, args.tokens, 1 << 16)]).half()  # [T, H, D]
    q = (torch.randn(SPEC.num_q_heads, SPEC.head_dim, device=dev, generator=g) * 2).half()
    ceiling = copy_ceiling_GBps(dev)
    rows = [bench_block_size(args, int(b), q, keys, ceiling) for b in args.blocks.split(",")]
    result = {"environment": environment(dev), "tokens": args.tokens, "budget": args.budget,
              "copy_ceiling_GBps": ceiling, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sketch_h200.json"), "w") as f:
        json.dump(result, f, indent=1)
    for r in rows:
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
