"""Sketch top-K selection at 1M tokens: the scan kernel's tuning sweep against the copy ceiling (one run).

    python -m bench_longctx.sketch_bench --out DIR [--tokens 1048576] [--budget 4096] [--blocks 64]

Llama-3-8B attention geometry (32 q / 8 kv heads, head_dim 128), one layer; keys drawn from
SmolLM2's key distribution (bench_longctx/needle.py). Per block size:
  sweep    the coarse pass (high plane of every block) for every setting of the kernel's knobs
           (blocks per program, field decode, num_warps, num_stages), then the fine pass (both
           planes of coarse_factor x k candidates) over blocks per program and num_warps; each
           setting's us and GB/s (bytes it must read / time; the copy ceiling is measured in the
           same run), whether its upper bound held on every block against the true keys, and its
           largest difference from the first 2048 blocks' torch reference
  select   SketchTopK.select_masked with the fastest knobs, eager and replayed from a CUDA graph,
           and Quest's fused selection (eviction/topk.py) for scale
Writes DIR/sketch_h200.json. CUDA only (the kernels are far too slow interpreted). ~2-3 minutes on an H200.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch

from bench_longctx.needle import background, key_distribution
from bench_longctx.select_bench import graph_us
from bench_longctx.timing import copy_ceiling_GBps, environment, time_ms, write_json
from eviction.select import protected_mask
from eviction.sketch import sketch_keys
from eviction.sketch_kernel import sketch_block_stats, sketch_block_stats_ref
from eviction.sketch_topk import SketchTopK
from eviction.topk import topk_select
from kvstore.config import ModelSpec

SPEC = ModelSpec.preset("llama3-8b", num_layers=1)
COARSE_SWEEP = dict(blocks_per_program=(1, 4, 16), decode=(0, 1), num_warps=(2, 4, 8), num_stages=(1, 3))
FINE_SWEEP = dict(blocks_per_program=(1, 2, 4), num_warps=(2, 4))
REF_BLOCKS = 2048  # the torch reference's slice (its int64 unpacking of every block would need ~17 GB at 1M)


def true_block_lse(q: torch.Tensor, keys: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """float32 [Hq, N]: log-sum-exp of the exact scaled logits per block."""
    num_tokens, num_kv_heads, head_dim = keys.shape
    logits = torch.einsum("hgd,thd->hgt", q.float().view(num_kv_heads, -1, head_dim), keys.float()).flatten(0, 1)
    n = -(-num_tokens // block_tokens)
    padded = torch.nn.functional.pad(logits / math.sqrt(head_dim), (0, n * block_tokens - num_tokens),
                                     value=float("-inf"))
    return padded.view(q.shape[0], n, block_tokens).logsumexp(-1)


def measure(run, nbytes: int, device: torch.device, true: torch.Tensor, ref, columns) -> dict:
    """One setting: us, GB/s, how many (head, block) bounds fell below the truth, largest gap to the reference."""
    try:
        lse, upper = run()
    except Exception as e:  # a setting the compiler refuses is a result, not the end of the sweep
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    us = 1e3 * time_ms(run, device)
    row = {"us": us, "GBps": nbytes / us / 1e3, "bound_violations": int((upper < true).sum())}
    if ref is not None:
        row["max_diff_vs_ref"] = max(float((lse[:, columns] - ref[0]).abs().max()),
                                     float((upper[:, columns] - ref[1]).abs().max()))
    return row


def sweep(space: dict, fixed: dict, run_for, nbytes, device, true, ref, columns) -> list[dict]:
    rows = []
    for values in itertools.product(*space.values()):
        knobs = {**fixed, **dict(zip(space, values))}
        rows.append({"knobs": knobs, **measure(lambda k=knobs: run_for(k), nbytes, device, true, ref, columns)})
    return rows


def fastest(rows: list[dict]) -> dict:
    ok = [r for r in rows if "us" in r and r["bound_violations"] == 0]
    return min(ok, key=lambda r: r["us"]) if ok else {"knobs": {}, "us": float("nan")}


def bench_block_size(args, block_tokens: int, q: torch.Tensor, keys: torch.Tensor, ceiling: float) -> dict:
    summaries, codes = sketch_keys(keys, block_tokens)
    n, h, d, t = summaries.shape[0], SPEC.num_kv_heads, SPEC.head_dim, keys.shape[0]
    dev = q.device
    k = args.budget // block_tokens
    policy = SketchTopK(coarse_factor=args.coarse_factor)
    g = torch.Generator(device=dev).manual_seed(1)
    candidates = torch.randint(0, n, (h, policy.coarse_factor * k), device=dev, generator=g)  # [H, C]
    true = true_block_lse(q, keys, block_tokens)  # [Hq, N]
    true_fine = true.gather(1, candidates.repeat_interleave(q.shape[0] // h, dim=0))
    m = min(REF_BLOCKS, n)
    ref_coarse = sketch_block_stats_ref(q, summaries[:m], codes[:m], m * block_tokens, planes=1)
    summary_bytes = h * 2 * d * 2  # per block
    plane_bytes = h * block_tokens * d // 4
    coarse_bytes = n * (summary_bytes + plane_bytes)
    fine_bytes = candidates.numel() * (summary_bytes + 2 * plane_bytes) // h
    row = {"block_tokens": block_tokens, "num_blocks": n, "coarse_MiB": coarse_bytes / 2**20,
           "fine_MiB": fine_bytes / 2**20, "coarse_ceiling_us": coarse_bytes / ceiling / 1e3,
           "sketch_bytes_per_token_per_kv_head": 2 * d // 4 + 2 * d * 2 / block_tokens,
           "kv_fp16_bytes_per_token_per_kv_head": 2 * d * 2}
    coarse = lambda knobs: sketch_block_stats(q, summaries, codes, t, planes=1, **knobs)  # noqa: E731
    row["coarse_sweep"] = sweep(COARSE_SWEEP, {}, coarse, coarse_bytes, dev, true, ref_coarse, slice(0, m))
    best = fastest(row["coarse_sweep"])
    row["coarse_best"] = best
    fixed = {"decode": best["knobs"].get("decode", 1), "num_stages": best["knobs"].get("num_stages", 3)}
    fine = lambda knobs: sketch_block_stats(q, summaries, codes, t, planes=2, block_ids=candidates,  # noqa: E731
                                            **knobs)
    row["fine_sweep"] = sweep(FINE_SWEEP, fixed, fine, fine_bytes, dev, true_fine, None, None)
    best_fine = fastest(row["fine_sweep"])
    row["fine_best"] = best_fine
    protected = protected_mask(num_tokens=t, block_tokens=block_tokens, sink_tokens=64, recent_tokens=1024,
                               device=dev)
    valid = torch.ones(n, dtype=torch.bool, device=dev)
    tuned = SketchTopK(coarse_factor=args.coarse_factor, scan_knobs=best["knobs"], candidate_knobs=best_fine["knobs"])
    for name, pol in (("default", policy), ("tuned", tuned)):
        select = lambda p=pol: p.select_masked(q, summaries, codes, valid, protected, k)  # noqa: E731
        row[f"select_{name}_us"] = 1e3 * time_ms(select, dev)
        row[f"select_{name}_graph_us"] = graph_us(select)
    quest = lambda: topk_select(q, summaries, num_tokens=t, block_tokens=block_tokens,  # noqa: E731
                                budget_tokens=args.budget, sink_tokens=64, recent_tokens=1024)
    row["quest_select_graph_us"] = graph_us(quest)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--blocks", default="64")
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
    write_json(args.out, "sketch_h200.json", result)
    for r in rows:
        print(json.dumps({"block_tokens": r["block_tokens"], "coarse_ceiling_us": round(r["coarse_ceiling_us"], 1),
                          "coarse_best": r["coarse_best"], "fine_best": r["fine_best"],
                          **{key: round(v, 1) for key, v in r.items() if key.startswith(("select", "quest"))}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
