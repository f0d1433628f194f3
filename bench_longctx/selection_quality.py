"""How much of dense attention's softmax mass each block selector keeps, on real SmolLM2 queries and keys.

    python -m bench_longctx.real_qk --tokens 8192 --steps 4 --out /tmp/qk.pt
    python -m bench_longctx.selection_quality /tmp/qk.pt [--out results.json] [--methods quest,sketch]

Per layer, kv head and decode step: the dense softmax of each q head over every key, the
mass per block (mean over the kv head's GQA group, as the store's kernel reports it), and
for each selector the mass of the blocks it picks at budget = context / 8, 16, 32 with
64 sink tokens and a 64-token recent window protected. The oracle picks the protected
blocks plus the blocks of highest true mass, the same count. Reported per (method, block
size, budget): mean over layer-heads of captured mass and of mass / oracle, and the worst
layer-head (each layer-head averaged over the steps first). The certified bound on the
omitted mass (eviction/certify.py) is checked against the true omitted mass on every case.
`sketch` is SketchTopK() (channel first level, head_dim // 2 channels; --channel-pairs: read in adjacent pairs).
`cascade` is CascadeTopK (eviction/cascade.py) with each layer's PCA basis fitted on the context's keys (as a store
would at prefill): Quest candidates in that basis, 4-bit rerank; its rows also report s (the unprotected blocks
passing its tau threshold) and how often every survivor was a candidate (result["cascade"]); `cascade_raw` is
the same on raw channels. Rows also give the worst layer (layer-heads averaged per layer) vs the oracle.
Numbers: BENCHMARKS.md, Selection quality.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from eviction.policy import ScoreContext
from eviction.cascade import CascadeTopK, pca_basis, rotate_keys
from eviction.certify import attended_lse, certified_omitted_mass, true_omitted_mass
from eviction.quest_kernel import quest_scores_ref
from eviction.select import SeqWindow, cdiv, select
from eviction.sketch import sketch_keys, token_estimates_ref
from eviction.sketch_topk import SketchTopK

SINK_TOKENS, RECENT_TOKENS = 64, 64
FRACTIONS = (8, 16, 32)
BLOCK_SIZES = (16, 32, 64)
RANK = 16  # SparQ channels / Loki dimensions: 16 of 64, the bytes of the 4-bit sketch in fp16


def _blocks(x: torch.Tensor, block_tokens: int, fill: float) -> torch.Tensor:
    """[..., T] -> [..., N, B], padded with `fill`."""
    n = cdiv(x.shape[-1], block_tokens)
    return torch.nn.functional.pad(x, (0, n * block_tokens - x.shape[-1]), value=fill).unflatten(-1, (n, block_tokens))


def estimate_to_blocks(est: torch.Tensor, num_kv_heads: int, block_tokens: int, reduce: str) -> torch.Tensor:
    """Token logit estimates [Hq, T] -> block scores [H, N]: max over tokens and group heads, or the
    estimated softmax mass per block (group mean)."""
    if reduce == "max":
        per_head = _blocks(est, block_tokens, float("-inf")).amax(-1)  # [Hq, N]
        return per_head.unflatten(0, (num_kv_heads, -1)).amax(1)
    per_head = _blocks(torch.softmax(est, dim=-1), block_tokens, 0.0).sum(-1)
    return per_head.unflatten(0, (num_kv_heads, -1)).mean(1)


def scorers(rank: int = RANK) -> dict[str, Callable]:
    """name -> f(q [Hq, D] fp16, keys [T, H, D] fp16, block_tokens, scale) -> block scores [H, N]."""
    def quest(q, keys, b, scale):
        from eviction.summaries import summarize_keys
        return quest_scores_ref(q, summarize_keys(keys, b))

    def sketch(planes, reduce):
        def f(q, keys, b, scale):
            summaries, codes = sketch_keys(keys, b)
            est, _ = token_estimates_ref(q, summaries, codes, planes)  # [Hq, N, B]
            est = est.flatten(1)[:, : keys.shape[0]] * scale
            return estimate_to_blocks(est, keys.shape[1], b, reduce)
        return f

    def exact_subset(project):
        def f(q, keys, b, scale):
            h = keys.shape[1]
            qg = q.float().view(h, -1, q.shape[-1])  # [H, G, D]
            est = torch.einsum("hgd,thd->hgt", *project(qg, keys.float())).flatten(0, 1) * scale  # [Hq, T]
            return estimate_to_blocks(est, h, b, "max")
        return f

    def sparq(qg, k):  # the `rank` channels of largest |q| summed over the group (SparQ, Ribar et al. 2024)
        idx = qg.abs().sum(1).topk(rank, dim=-1).indices  # [H, r]
        return (torch.gather(qg, 2, idx[:, None].expand(-1, qg.shape[1], -1)),
                torch.gather(k, 2, idx[None].expand(k.shape[0], -1, -1)))

    def loki(qg, k):  # top principal directions of this layer-head's keys (Loki, Singhania et al. 2024)
        basis = torch.linalg.eigh(torch.einsum("thd,the->hde", k, k) / k.shape[0]).eigenvectors[..., -rank:]
        return qg @ basis, torch.einsum("thd,hdr->thr", k, basis)

    def centroid(q, keys, b, scale):
        h = keys.shape[1]
        mean = _blocks(keys.float().permute(1, 2, 0), b, 0.0).sum(-1)  # [H, D, N]
        counts = _blocks(torch.ones(keys.shape[0], device=keys.device), b, 0.0).sum(-1)  # [N]
        return torch.bmm(q.float().view(h, -1, q.shape[-1]), mean / counts).amax(1)

    return {"quest": quest, "sketch4": sketch(2, "max"), "sketch4_mass": sketch(2, "mass"),
            "sketch2": sketch(1, "max"), "sketch2_mass": sketch(1, "mass"), "sparq16": exact_subset(sparq),
            "loki16": exact_subset(loki),
            "centroid": centroid}


def dense_block_mass(q: torch.Tensor, keys: torch.Tensor, block_tokens: int,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(block mass [H, N] (group mean of each q head's softmax), logits [Hq, T])."""
    h = keys.shape[1]
    logits = torch.einsum("hgd,thd->hgt", q.float().view(h, -1, q.shape[-1]), keys.float()).flatten(0, 1) * scale
    per_head = _blocks(torch.softmax(logits, dim=-1), block_tokens, 0.0).sum(-1)  # [Hq, N]
    return per_head.unflatten(0, (h, -1)).mean(1), logits


def evaluate_step(q: torch.Tensor, keys: torch.Tensor, block_tokens: int, fractions, methods: dict,
                  policy: SketchTopK | None, cascades: tuple[CascadeTopK, ...] = ()) -> dict:
    """(method, fraction) -> captured mass [H]; for the sketch policy also (certified, true) omitted mass [H];
    for each cascade (`cascade` with a basis, `cascade_raw` without) also (survivor fraction, complete) [2, H]."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    mass, logits = dense_block_mass(q, keys, block_tokens, scale)
    context = keys.shape[0]
    window = SeqWindow(num_tokens=context, block_tokens=block_tokens, sink_tokens=SINK_TOKENS,
                       recent_tokens=RECENT_TOKENS)
    scores = {name: f(q, keys, block_tokens, scale) for name, f in methods.items()}
    if policy is not None:
        summaries, codes = sketch_keys(keys, block_tokens)
        ctx = ScoreContext(summaries, window, q=q, sketch=codes)
    cascade_ctx = {}
    for c in cascades:
        name = "cascade_raw" if c.basis is None else "cascade"
        rotated = keys if c.basis is None else rotate_keys(keys, c.basis)
        rotated_summaries, rotated_codes = sketch_keys(rotated, block_tokens)
        cascade_ctx[name] = (c, ScoreContext(rotated_summaries, window, q=q, sketch=rotated_codes))
    out = {}
    for frac in fractions:
        budget = (context // frac) // block_tokens * block_tokens
        out[("oracle", frac)] = mass.gather(1, select(mass, window, budget)).sum(1)
        for name, sc in scores.items():
            out[(name, frac)] = mass.gather(1, select(sc, window, budget)).sum(1)
        if policy is not None:
            chosen, upper = policy.select_with_bounds(ctx, budget)
            out[("sketch", frac)] = mass.gather(1, chosen).sum(1)
            certified = certified_omitted_mass(upper, chosen, attended_lse(logits, chosen, block_tokens))
            out[("certified", frac)] = torch.stack((certified, true_omitted_mass(logits, chosen, block_tokens)))
        for name, (c, c_ctx) in cascade_ctx.items():
            chosen, stats = c.select_with_stats(c_ctx, budget)
            out[(name, frac)] = mass.gather(1, chosen).sum(1)
            out[(name + "_check", frac)] = torch.stack((stats.survivor_fraction, stats.complete.float()))
    return out


def run(path: str, method_names: list[str] | None = None, block_sizes=BLOCK_SIZES, fractions=FRACTIONS,
        layers: list[int] | None = None, progress: Callable = lambda it, _: it,
        sketch: SketchTopK | None = None, cascade: CascadeTopK | None = None) -> dict:
    """Every case of a real_qk capture file."""
    data = torch.load(path, weights_only=True)
    return evaluate(data["keys"], data["queries"], method_names, block_sizes, fractions, layers, progress, sketch,
                    cascade)


def evaluate(keys_all: list[torch.Tensor], queries_all: list[torch.Tensor], method_names: list[str] | None = None,
             block_sizes=BLOCK_SIZES, fractions=FRACTIONS, layers: list[int] | None = None,
             progress: Callable = lambda it, _: it, sketch: SketchTopK | None = None,
             cascade: CascadeTopK | None = None) -> dict:
    """Rows per (method, block size, budget) and the certificate's check, over keys [T, H, D] and the
    queries [steps, Hq, D] of the last positions, per layer (bench_longctx.real_qk.capture). sketch: the
    `sketch` method's policy (default SketchTopK()); cascade: the settings of `cascade` (its basis replaced by
    each layer's PCA basis) and `cascade_raw` (raw channels), default CascadeTopK()."""
    steps = queries_all[0].shape[0]
    names = list(scorers()) + ["sketch", "cascade"] if method_names is None else method_names
    methods = {k: v for k, v in scorers().items() if k in names}
    policy = (sketch or SketchTopK()) if "sketch" in names else None
    template = cascade or CascadeTopK()
    layers = list(range(len(keys_all))) if layers is None else layers
    context = keys_all[0].shape[0] - steps
    acc: dict = {}
    for layer in progress(layers, "selection quality"):
        cascades = tuple([replace(template, basis=pca_basis(keys_all[layer][:context]))] * ("cascade" in names)
                         + [replace(template, basis=None)] * ("cascade_raw" in names))
        for s in range(steps):
            keys = keys_all[layer][: context + s + 1]  # on the capture's device (CUDA: the sketch kernel runs)
            q = queries_all[layer][s]
            for b in block_sizes:
                for (name, frac), m in evaluate_step(q, keys, b, fractions, methods, policy, cascades).items():
                    acc.setdefault((name, b, frac), []).append(m)  # [H] (or [2, H]) per (layer, step)
    rows, certificate, cascade_rows = [], [], []
    for (name, b, frac), values in acc.items():
        if name == "certified":
            certificate.append({"selector": "sketch", **certificate_row(torch.stack(values), b, frac)})
            continue
        if name.endswith("_check"):
            pairs = torch.stack(values)  # [cases, 2, H]
            cascade_rows.append({"method": name[:-len("_check")], "block_tokens": b, "budget_fraction": f"1/{frac}",
                                 "tau": template.tau, "candidate_factor": template.candidate_factor,
                                 "mean_survivor_fraction": float(pairs[:, 0].mean()),
                                 "max_survivor_fraction": float(pairs[:, 0].max()),
                                 "complete_fraction": float(pairs[:, 1].mean())})
            continue
        per = torch.stack(values).view(len(layers), steps, -1).mean(1)  # [L, H]: mass averaged over steps
        oracle = torch.stack(acc[("oracle", b, frac)]).view(len(layers), steps, -1).mean(1)
        ratio = per / oracle
        worst = int(ratio.argmin())
        rows.append({"method": name, "block_tokens": b, "budget_fraction": f"1/{frac}", "budget": context // frac,
                     "mean_mass": float(per.mean()), "worst_mass": float(per.min()),
                     "mean_vs_oracle": float(ratio.mean()), "worst_vs_oracle": float(ratio.min()),
                     "worst_layer_head": [layers[worst // per.shape[1]], worst % per.shape[1]],
                     "worst_layer_vs_oracle": float(ratio.mean(1).min())})
    return {"context": context, "steps": steps, "layers": len(layers), "kv_heads": keys_all[0].shape[1],
            "sink_tokens": SINK_TOKENS, "recent_tokens": RECENT_TOKENS, "rows": rows, "certificate": certificate,
            "cascade": cascade_rows}


def certificate_row(pairs: torch.Tensor, block_tokens: int, frac: int) -> dict:
    """pairs [cases, 2, H]: (certified, true) omitted mass of the sketch policy's selection."""
    certified, true = pairs[:, 0].flatten(), pairs[:, 1].flatten()
    below = int((certified < true * (1 - 1e-5) - 1e-7).sum())
    ratio = certified / true.clamp_min(1e-12)
    return {"block_tokens": block_tokens, "budget_fraction": f"1/{frac}", "cases": certified.numel(),
            "below_true": below, "mean_true": float(true.mean()), "mean_certified": float(certified.mean()),
            "ratio_of_means": float(certified.mean() / true.mean()), "median_ratio": float(ratio.median()),
            "p90_ratio": float(ratio.quantile(0.9))}


def table(result: dict) -> str:
    lines = ["| method | block | budget | mean mass | worst mass | mean vs oracle | worst vs oracle |",
             "|" + "---|" * 7]
    for r in sorted(result["rows"], key=lambda r: (r["block_tokens"], -r["budget"], r["method"])):
        lines.append(f"| {r['method']} | {r['block_tokens']} | {r['budget_fraction']} | {r['mean_mass']:.3f} | "
                     f"{r['worst_mass']:.3f} | {r['mean_vs_oracle']:.3f} | {r['worst_vs_oracle']:.3f} |")
    lines += ["", "| selector | block | budget | cases | certified < true | mean true omitted | mean certified | "
              "ratio of means | median ratio | p90 ratio |", "|" + "---|" * 10]
    for c in sorted(result["certificate"], key=lambda c: (c["selector"], c["block_tokens"], c["budget_fraction"])):
        lines.append(f"| {c['selector']} | {c['block_tokens']} | {c['budget_fraction']} | {c['cases']} | "
                     f"{c['below_true']} | "
                     f"{c['mean_true']:.4f} | {c['mean_certified']:.4f} | {c['ratio_of_means']:.2f} | "
                     f"{c['median_ratio']:.2f} | {c['p90_ratio']:.2f} |")
    lines += ["", "| cascade | block | budget | tau | mean s | max s | every survivor a candidate |", "|" + "---|" * 7]
    for c in sorted(result.get("cascade", []), key=lambda c: (c["method"], c["block_tokens"], c["budget_fraction"])):
        lines.append(f"| {c['method']} | {c['block_tokens']} | {c['budget_fraction']} | {c['tau']} | "
                     f"{c['mean_survivor_fraction']:.3f} | {c['max_survivor_fraction']:.3f} | "
                     f"{c['complete_fraction']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("qk", help="file written by bench_longctx.real_qk")
    every = [*scorers(), "sketch", "cascade", "cascade_raw"]
    parser.add_argument("--methods", default=None, help="comma-separated subset of " + ",".join(every))
    parser.add_argument("--blocks", default=",".join(map(str, BLOCK_SIZES)))
    parser.add_argument("--channel-pairs", action="store_true",
                        help="the sketch's first level reads its channels in adjacent pairs (SketchTopK.channel_pairs)")
    parser.add_argument("--candidate-factor", type=int, default=4, help="cascade: candidates = this x k")
    parser.add_argument("--tau", type=float, default=0.05, help="cascade: the threshold's token weight")
    parser.add_argument("--fractions", default=",".join(map(str, FRACTIONS)), help="budgets: context / each")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    t0 = time.time()
    result = run(args.qk, args.methods.split(",") if args.methods else None,
                 tuple(int(b) for b in args.blocks.split(",")), tuple(int(f) for f in args.fractions.split(",")),
                 sketch=SketchTopK(channel_pairs=args.channel_pairs),
                 cascade=CascadeTopK(candidate_factor=args.candidate_factor, tau=args.tau))
    result["channel_pairs"] = args.channel_pairs
    result["seconds"] = time.time() - t0
    print(table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
