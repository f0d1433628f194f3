"""Sketch top-K selection at 1M tokens: the channel first level at several channel counts, with Quest (one GPU run).

    python -m bench_longctx.sketch_bench --out DIR [--tokens 1048576] [--budget 4096] [--block 64] [--channels 16,32,64]
        [--pairs 0,1]

Llama-3-8B attention geometry (32 q / 8 kv heads, head_dim 128), one layer: keys drawn from SmolLM2's key
distribution with 10 norm-matched needles at graded margins (bench_longctx/needle.py's haystack; each needle
has its own query, isotropic: the channel first level's hard case), coded channel-major (eviction/sketch.py).
  first_level  the channel pass (eviction/sketch_channels.py) for r in --channels (and --pairs) over a knob sweep
               ({} first: the CUDA kernel where it serves): us (eager), graph_us (replayed from a CUDA graph: the
               GPU's time), GB/s of the bytes it must read, bound violations against the true keys' per-block
               log-sum-exp (every block, needle query 0), largest difference from the torch reference over the first
               REF_BLOCKS blocks
  stages       the sketch selection's steps alone: ranking, candidate top-k, fine pass with merge (over FINE_SWEEP,
               the default knobs first), final top-k; replayed from a CUDA graph on CUDA (eager times there are the
               host's launch cost), eager elsewhere. The selection below runs the default fine pass
  select       select_masked eager and replayed from a CUDA graph: the sketch per r, Quest's selection for scale
  needles      per needle query and selector (the sketch per r, Quest): recall of (needle, q head) pairs holding
               >= 5% of the dense softmax (the needle's block selected), dense mass the selection holds, bound
               violations (blocks whose upper bound is below the true log-sum-exp) and the certified omitted
               mass (eviction/certify.py) against the true one
Writes DIR/sketch_h200.json (device, date, command inside). ~2-3 minutes on an H200. Without CUDA it is a smoke run
of the same code under TRITON_INTERPRET=1 (use a small --tokens; no graph timings). Numbers: BENCHMARKS.md, Sketch
selector.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch

from bench_longctx.needle import haystack, logits
from bench_longctx.presets import NeedlePreset
from bench_longctx.select_bench import graph_us
from bench_longctx.timing import copy_ceiling_GBps, environment, time_ms, write_json
from eviction import sketch_mma
from eviction.certify import attended_lse, certified_omitted_mass, true_omitted_mass
from eviction.select import SeqWindow, top_blocks
from eviction.sketch import sketch_keys
from eviction.sketch_channels import channel_block_stats, channel_block_stats_ref
from eviction.sketch_kernel import refine_candidates
from eviction.sketch_rank import block_shares
from eviction.sketch_topk import SketchTopK
from eviction.topk import topk_select
from kvstore.config import ModelSpec

SPEC = ModelSpec.preset("llama3-8b", num_layers=1)
SINK, RECENT, MIN_WEIGHT = 64, 256, 0.05
# {} first: the default path (eviction/sketch_mma.py's CUDA kernel where it serves); explicit knobs time Triton's
SCAN_SWEEP = [{}] + [dict(blocks_per_program=b, num_warps=w) for b, w in ((4, 2), (8, 4), (8, 8), (16, 4), (16, 8))]
FINE_SWEEP = [{}] + [dict(blocks_per_program=b, num_warps=w) for b, w in ((1, 2), (2, 2), (1, 4))]  # {}: REFINE_KNOBS
REF_BLOCKS = 1024  # the torch reference's slice


def true_block_lse(q: torch.Tensor, keys: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """float32 [Hq, N]: log-sum-exp of the exact scaled logits per block."""
    num_tokens, num_kv_heads, head_dim = keys.shape
    logits = torch.einsum("hgd,thd->hgt", q.float().view(num_kv_heads, -1, head_dim), keys.float()).flatten(0, 1)
    n = -(-num_tokens // block_tokens)
    padded = torch.nn.functional.pad(logits / math.sqrt(head_dim), (0, n * block_tokens - num_tokens),
                                     value=float("-inf"))
    return padded.view(q.shape[0], n, block_tokens).logsumexp(-1)


def timed_row(run, nbytes: int, true: torch.Tensor, ref=None) -> dict:
    """One setting: us, GB/s of the bytes it must read, bound violations, largest gap to the reference."""
    try:
        lse, upper = run()
    except Exception as e:  # a setting the compiler refuses is a result, not the end of the sweep
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    us = 1e3 * time_ms(run, true.device)
    row = {"us": us, "GBps": nbytes / us / 1e3, "bound_violations": int((upper < true).sum())}
    if true.device.type == "cuda":  # eager timing includes the host's launch cost where it exceeds the GPU's
        row["graph_us"] = graph_us(run)
    if ref is not None:
        m = ref[0].shape[1]
        row["max_diff_vs_ref"] = max(float((lse[:, :m] - ref[0]).abs().max()),
                                     float((upper[:, :m] - ref[1]).abs().max()))
    return row


def fastest(rows: list[dict]) -> dict:
    ok = [r for r in rows if "us" in r and r["bound_violations"] == 0]
    return min(ok, key=lambda r: r["us"]) if ok else {"knobs": {}, "us": float("nan")}


def name(r: int, pairs: bool) -> str:
    return f"channels_{r}" + ("_pairs" if pairs else "")


def first_levels(args, q, summaries, codes, true) -> dict:
    n, h, d, b = summaries.shape[0], SPEC.num_kv_heads, SPEC.head_dim, args.block
    t = n * b
    summary_bytes = n * h * 2 * d * 2
    out = {}
    m = min(REF_BLOCKS, n)
    for r, pairs in ((r, pairs) for r in args.channels for pairs in args.pairs):
        ref = channel_block_stats_ref(q, summaries[:m], codes[:m], m * b, r, pairs=pairs)
        nbytes = summary_bytes + n * h * r * b // 2
        cuda = sketch_mma.usable(q, summaries, codes, r)
        rows = [{"knobs": k, "kernel": "cuda" if cuda and not k else "triton",
                 **timed_row(lambda k=k: channel_block_stats(q, summaries, codes, t, r, pairs=pairs, **k), nbytes,
                             true, ref)}
                for k in args.scan_sweep]
        out[name(r, pairs)] = {"sweep": rows, "best": fastest(rows), "MiB": nbytes / 2**20}
    return out


def step_us(fn, device: torch.device) -> float:
    """Microseconds of fn: replayed from a CUDA graph on CUDA, eager elsewhere."""
    return graph_us(fn) if device.type == "cuda" else 1e3 * time_ms(fn, device)


def stages(args, q, summaries, codes, valid, protected, k, r, knobs, pairs=False) -> dict:
    """The sketch selection's steps alone (module docstring)."""
    h, t = SPEC.num_kv_heads, summaries.shape[0] * args.block
    keep = protected & valid
    lse, upper = channel_block_stats(q, summaries, codes, t, r, valid, pairs=pairs, **knobs)
    scores, z = block_shares(lse, keep, valid, h)
    c = SketchTopK().num_candidates(k)
    candidates = top_blocks(scores, c)
    row = {"rank_us": step_us(lambda: block_shares(lse, keep, valid, h), q.device),
           "candidates_topk_us": step_us(lambda: top_blocks(scores, c), q.device)}
    fine = [{"knobs": f, "us": step_us(lambda f=f: refine_candidates(q, summaries, codes, candidates, z, keep, valid,
                                                                       upper.clone(), **f), q.device)}
            for f in FINE_SWEEP]
    row["fine_sweep"], row["fine_best"] = fine, min(fine, key=lambda x: x["us"])
    scores_c = refine_candidates(q, summaries, codes, candidates, z, keep, valid, upper, **row["fine_best"]["knobs"])
    row["final_topk_us"] = step_us(lambda: candidates.gather(1, top_blocks(scores_c, k)), q.device)
    return row


def needle_recall(hay: dict, selectors: dict, block_tokens: int) -> dict:
    """Per selector: recall of (needle, q head) pairs >= MIN_WEIGHT, mean dense mass held, bound violations and the
    certificate (certified vs true omitted mass, per kv head) over every needle query."""
    keys = hay["keys"]
    num_kv_heads = keys.shape[1]
    group = hay["queries"].shape[1] // num_kv_heads
    out = {name: {"found": 0, "trials": 0, "mass": [], "bound_violations": 0, "cert_below_true": 0, "certified": [],
                  "true_omitted": []} for name in selectors}
    for i, q in enumerate(hay["queries"]):
        logit = logits(q, keys)  # [Hq, T]
        n = -(-keys.shape[0] // block_tokens)
        padded = torch.nn.functional.pad(logit, (0, n * block_tokens - keys.shape[0]), value=float("-inf"))
        block_lse = padded.view(q.shape[0], n, block_tokens).logsumexp(-1)  # [Hq, N]
        mass = torch.softmax(block_lse, dim=1).view(num_kv_heads, group, n).mean(1)  # [H, N]
        counted = hay["weights"][i] >= MIN_WEIGHT  # [Hq]
        needle_block = hay["positions"][i] // block_tokens
        for name, select in selectors.items():
            selected, upper = select(q)
            row = out[name]
            held = (selected == needle_block).any(1).repeat_interleave(group)  # [Hq]
            row["found"] += int((held & counted).sum())
            row["trials"] += int(counted.sum())
            row["mass"].append(float(mass.gather(1, selected).sum(1).mean()))
            if upper is not None:
                row["bound_violations"] += int((upper < block_lse - 1e-4).sum())
                certified = certified_omitted_mass(upper, selected, attended_lse(logit, selected, block_tokens))
                true = true_omitted_mass(logit, selected, block_tokens)
                row["cert_below_true"] += int((certified < true * (1 - 1e-5) - 1e-7).sum())
                row["certified"].append(float(certified.mean()))
                row["true_omitted"].append(float(true.mean()))
    for row in out.values():
        row["recall"] = row["found"] / row["trials"] if row["trials"] else None
        row["mean_mass"] = sum(row.pop("mass")) / len(hay["queries"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--channels", default="16,32,64", help="first-level channel counts to time and score")
    parser.add_argument("--pairs", default="0", help="channel plans to run: 0 single channels, 1 adjacent pairs, "
                        "0,1 both (eviction/sketch_channels.py read_channels_ref)")
    parser.add_argument("--scan-sweep", default=None, help="the first level's knob settings to time, a JSON list of "
                        "dicts (default: SCAN_SWEEP)")
    args = parser.parse_args(argv)
    args.channels = [int(c) for c in args.channels.split(",")]
    args.pairs = [bool(int(x)) for x in args.pairs.split(",")]
    args.scan_sweep = json.loads(args.scan_sweep) if args.scan_sweep else SCAN_SWEEP
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("sketch_bench needs CUDA, or TRITON_INTERPRET=1 and a small --tokens for a smoke run")
        return 2
    preset = NeedlePreset(geometry="llama3-8b", contexts=(args.tokens,), budgets=(args.budget,), needles=10,
                          sink_tokens=SINK, recent_tokens=RECENT, block_tokens=args.block)
    hay = haystack(SPEC, args.tokens, preset, dev, seed=args.tokens)
    hay.pop("values")
    keys, b = hay["keys"], args.block
    summaries, codes = sketch_keys(keys, b)
    n, t = summaries.shape[0], keys.shape[0]
    result = {"environment": environment(dev), "tokens": t, "budget": args.budget, "block_tokens": b,
              "num_blocks": n, "copy_ceiling_GBps": copy_ceiling_GBps(dev),
              "sketch_bytes_per_token_per_kv_head": SPEC.head_dim // 2 + 2 * SPEC.head_dim * 2 / b,
              "kv_fp16_bytes_per_token_per_kv_head": 2 * SPEC.head_dim * 2}
    q = hay["queries"][0]
    true = true_block_lse(q, keys, b)
    result["first_level"] = first_levels(args, q, summaries, codes, true)
    write_json(args.out, "sketch_h200.json", result)
    valid = torch.ones(n, dtype=torch.bool, device=dev)
    window = SeqWindow(num_tokens=t, block_tokens=b, sink_tokens=SINK, recent_tokens=RECENT)
    protected = window.protected_mask(dev)
    k = args.budget // b
    policies = {}
    for r, pairs in ((r, pairs) for r in args.channels for pairs in args.pairs):
        scan = result["first_level"][name(r, pairs)]["best"].get("knobs", {})
        result[f"stages_{r}" + ("_pairs" if pairs else "")] = stages(args, q, summaries, codes, valid, protected, k,
                                                                    r, scan, pairs)
        policies[f"sketch_r{r}" + ("_pairs" if pairs else "")] = SketchTopK(
            channels=r, channel_pairs=pairs, use_kernel=True, scan_knobs=scan)
    selectors = {name: (lambda x, p=p: p.select_masked(x, summaries, codes, valid, protected, k))
                 for name, p in policies.items()}
    selectors["quest"] = lambda x: (topk_select(x, summaries, window, budget_tokens=args.budget), None)
    result["select"] = {name: {"eager_us": 1e3 * time_ms(lambda f=f: f(q), dev),
                               "graph_us": graph_us(lambda f=f: f(q)) if dev.type == "cuda" else float("nan")}
                        for name, f in selectors.items()}
    write_json(args.out, "sketch_h200.json", result)
    result["needles"] = needle_recall(hay, selectors, b)
    result["needle_weights"] = [[round(float(w), 4) for w in row] for row in hay["weights"].cpu()]
    path = write_json(args.out, "sketch_h200.json", result)
    summary = {"first_level_us": {name: round(row.get("us", row.get("best", {}).get("us", float("nan"))), 1)
                                  for name, row in result["first_level"].items()},
               "first_level_graph_us": {name: round(row.get("best", {}).get("graph_us", float("nan")), 1)
                                        for name, row in result["first_level"].items()},
               "select_graph_us": {name: round(row["graph_us"], 1) for name, row in result["select"].items()},
               "recall": {name: row["recall"] for name, row in result["needles"].items()},
               "bound_violations": {name: row["bound_violations"] for name, row in result["needles"].items()},
               "cert_below_true": {name: row["cert_below_true"] for name, row in result["needles"].items()}}
    print(json.dumps(summary))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
