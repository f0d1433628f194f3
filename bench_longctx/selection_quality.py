"""How much of dense attention's softmax mass each block selector keeps, on real SmolLM2 queries and keys.

    python -m bench_longctx.real_qk --tokens 8192 --steps 4 --out /tmp/qk.pt
    python -m bench_longctx.selection_quality /tmp/qk.pt [--out results.json] [--methods quest,sketch]
        [--candidate-factors 4,16] [--recent-tokens 64|store]

Per layer, kv head and decode step: the dense softmax of each q head over every key, the
mass per block (mean over the kv head's GQA group, as the store's kernel reports it), and
for each selector the mass of the blocks it picks at budget = context / 8, 16, 32 with
64 sink tokens and a recent window protected inside the budget: 64 tokens, or with
--recent-tokens store the window a store with the default Config forces (1,024 tokens, at most
1/8 of the budget). The oracle picks the protected blocks plus the blocks of highest true mass,
the same count; `oracle_free` the blocks of highest true mass with nothing protected, the same
count (what the window costs). Reported per (method, block size, budget): mean over layer-heads
of captured mass and of mass / oracle, the worst layer-head (each layer-head averaged over the
steps first), the worst layer (layer-heads averaged per layer), and mean and worst layer against
oracle_free. The certified bound on the omitted mass (eviction/certify.py) is checked against
the true omitted mass on every case.
`sketch` is SketchTopK() (channel first level, head_dim // 2 channels; --channel-pairs: read in adjacent pairs).
`cascade` is CascadeTopK (eviction/cascade.py) with each layer's PCA basis fitted on the context's keys (as a store
would at prefill): Quest candidates in that basis, 4-bit rerank; `cascade_raw` is the same on raw channels (the
store's mode="cascade"). One of each per --candidate-factors entry: the first unsuffixed, the others `_c<factor>`.
Each also gives a `<name>_ceiling` row: the protected blocks plus its candidates of highest true mass (a perfect
ranking of the candidates: below the oracle, the candidate stage lost mass; between it and the cascade, the 4-bit
ranking did), and rows of s (the unprotected blocks passing its tau threshold) and how often every survivor was a
candidate (result["cascade"]).
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
from eviction.select import SeqWindow, select, top_blocks
from eviction.sketch import sketch_keys
from eviction.sketch_topk import SketchTopK
from kvstore.decode.eager import RECENT_SHARE

from bench_longctx.block_estimators import blocks_of, scorers

SINK_TOKENS, RECENT_TOKENS = 64, 64
STORE_RECENT_TOKENS = 1024  # Config.recent_tokens at the default hot window (kvstore/config.py)
FRACTIONS = (8, 16, 32)
BLOCK_SIZES = (16, 32, 64)


def dense_block_mass(q: torch.Tensor, keys: torch.Tensor, block_tokens: int,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(block mass [H, N] (group mean of each q head's softmax), logits [Hq, T])."""
    h = keys.shape[1]
    logits = torch.einsum("hgd,thd->hgt", q.float().view(h, -1, q.shape[-1]), keys.float()).flatten(0, 1) * scale
    per_head = blocks_of(torch.softmax(logits, dim=-1), block_tokens, 0.0).sum(-1)  # [Hq, N]
    return per_head.unflatten(0, (h, -1)).mean(1), logits


def recent_window(budget: int, recent_tokens: int | None) -> int:
    """The recent window kept at `budget`: recent_tokens, or with None the store's (STORE_RECENT_TOKENS, at most
    budget / RECENT_SHARE: kvstore/decode/eager.py DecodePath.recent_window)."""
    return min(STORE_RECENT_TOKENS, budget // RECENT_SHARE) if recent_tokens is None else recent_tokens


def candidate_ceiling(mass: torch.Tensor, window: SeqWindow, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [H, k]: the protected blocks plus the candidates [H, C] of highest true mass [H, N]."""
    picked = mass.gather(1, candidates).masked_fill(window.protected_mask(mass.device)[candidates], float("inf"))
    return candidates.gather(1, top_blocks(picked, k))


def evaluate_step(q: torch.Tensor, keys: torch.Tensor, block_tokens: int, fractions, methods: dict,
                  policy: SketchTopK | None, cascades: dict[str, CascadeTopK] | None = None,
                  recent_tokens: int | None = RECENT_TOKENS) -> dict:
    """(method, fraction) -> captured mass [H]; for the sketch policy also (certified, true) omitted mass [H];
    for each cascade also its candidate ceiling and (survivor fraction, complete) [2, H]."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    mass, logits = dense_block_mass(q, keys, block_tokens, scale)
    context = keys.shape[0]
    scores = {name: f(q, keys, block_tokens, scale) for name, f in methods.items()}
    sketches = {None: sketch_keys(keys, block_tokens)}  # basis id -> (summaries, codes) of the keys in it
    for c in (cascades or {}).values():
        if c.basis is not None and id(c.basis) not in sketches:
            sketches[id(c.basis)] = sketch_keys(rotate_keys(keys, c.basis), block_tokens)
    out = {}
    for frac in fractions:
        budget = (context // frac) // block_tokens * block_tokens
        window = SeqWindow(num_tokens=context, block_tokens=block_tokens, sink_tokens=SINK_TOKENS,
                           recent_tokens=recent_window(budget, recent_tokens))
        k = window.num_selected(budget)
        out[("oracle", frac)] = mass.gather(1, select(mass, window, budget)).sum(1)
        out[("oracle_free", frac)] = mass.gather(1, top_blocks(mass, k)).sum(1)
        for name, sc in scores.items():
            out[(name, frac)] = mass.gather(1, select(sc, window, budget)).sum(1)
        if policy is not None:
            summaries, codes = sketches[None]
            chosen, upper = policy.select_with_bounds(ScoreContext(summaries, window, q=q, sketch=codes), budget)
            out[("sketch", frac)] = mass.gather(1, chosen).sum(1)
            certified = certified_omitted_mass(upper, chosen, attended_lse(logits, chosen, block_tokens))
            out[("certified", frac)] = torch.stack((certified, true_omitted_mass(logits, chosen, block_tokens)))
        for name, c in (cascades or {}).items():
            summaries, codes = sketches[None if c.basis is None else id(c.basis)]
            chosen, stats = c.select_with_stats(ScoreContext(summaries, window, q=q, sketch=codes), budget)
            out[(name, frac)] = mass.gather(1, chosen).sum(1)
            ceiling = candidate_ceiling(mass, window, stats.candidate_ids, k)
            out[(name + "_ceiling", frac)] = mass.gather(1, ceiling).sum(1)
            out[(name + "_check", frac)] = torch.stack((stats.survivor_fraction, stats.complete.float()))
    return out


def run(path: str, method_names: list[str] | None = None, block_sizes=BLOCK_SIZES, fractions=FRACTIONS,
        layers: list[int] | None = None, progress: Callable = lambda it, _: it,
        sketch: SketchTopK | None = None, cascade: CascadeTopK | None = None,
        candidate_factors: tuple[int, ...] = (), recent_tokens: int | None = RECENT_TOKENS) -> dict:
    """Every case of a real_qk capture file."""
    data = torch.load(path, weights_only=True)
    return evaluate(data["keys"], data["queries"], method_names, block_sizes, fractions, layers, progress, sketch,
                    cascade, candidate_factors, recent_tokens)


def layer_cascades(template: CascadeTopK, factors: tuple[int, ...], names: list[str],
                   context_keys: torch.Tensor) -> dict[str, CascadeTopK]:
    """name -> policy for one layer: `cascade` in the PCA basis of its context keys [T, H, D], `cascade_raw` on raw
    channels, each at every candidate factor (the template's unsuffixed, others `_c<factor>`)."""
    bases = {"cascade": pca_basis(context_keys) if "cascade" in names else None, "cascade_raw": None}
    return {name + ("" if f == template.candidate_factor else f"_c{f}"): replace(template, basis=basis,
                                                                                  candidate_factor=f)
            for name, basis in bases.items() if name in names for f in factors}


def evaluate(keys_all: list[torch.Tensor], queries_all: list[torch.Tensor], method_names: list[str] | None = None,
             block_sizes=BLOCK_SIZES, fractions=FRACTIONS, layers: list[int] | None = None,
             progress: Callable = lambda it, _: it, sketch: SketchTopK | None = None,
             cascade: CascadeTopK | None = None, candidate_factors: tuple[int, ...] = (),
             recent_tokens: int | None = RECENT_TOKENS) -> dict:
    """Rows per (method, block size, budget) and the certificate's check, over keys [T, H, D] and the
    queries [steps, Hq, D] of the last positions, per layer (bench_longctx.real_qk.capture). sketch: the
    `sketch` method's policy (default SketchTopK()); cascade: the settings of `cascade` (its basis replaced by
    each layer's PCA basis) and `cascade_raw` (raw channels), default CascadeTopK(), run at each of
    candidate_factors (default: the template's); recent_tokens: the recent window, None: the store's."""
    steps = queries_all[0].shape[0]
    names = list(scorers()) + ["sketch", "cascade"] if method_names is None else method_names
    methods = {k: v for k, v in scorers().items() if k in names}
    policy = (sketch or SketchTopK()) if "sketch" in names else None
    template = cascade or CascadeTopK()
    factors = tuple(candidate_factors) or (template.candidate_factor,)
    layers = list(range(len(keys_all))) if layers is None else layers
    context = keys_all[0].shape[0] - steps
    acc: dict = {}
    for layer in progress(layers, "selection quality"):
        cascades = layer_cascades(template, factors, names, keys_all[layer][:context])
        for s in range(steps):
            keys = keys_all[layer][: context + s + 1]  # on the capture's device (CUDA: the sketch kernel runs)
            q = queries_all[layer][s]
            for b in block_sizes:
                for (name, frac), m in evaluate_step(q, keys, b, fractions, methods, policy, cascades,
                                                     recent_tokens).items():
                    acc.setdefault((name, b, frac), []).append(m)  # [H] (or [2, H]) per (layer, step)
    factor_of = {name: c.candidate_factor for name, c in cascades.items()}
    rows, certificate, cascade_rows = [], [], []
    for (name, b, frac), values in acc.items():
        if name == "certified":
            certificate.append({"selector": "sketch", **certificate_row(torch.stack(values), b, frac)})
        elif name.endswith("_check"):
            pairs = torch.stack(values)  # [cases, 2, H]
            cascade_rows.append({"method": name[:-len("_check")], "block_tokens": b, "budget_fraction": f"1/{frac}",
                                 "tau": template.tau, "candidate_factor": factor_of[name[:-len("_check")]],
                                 "mean_survivor_fraction": float(pairs[:, 0].mean()),
                                 "max_survivor_fraction": float(pairs[:, 0].max()),
                                 "complete_fraction": float(pairs[:, 1].mean())})
        else:
            per_case = [torch.stack(acc[(key, b, frac)]).view(len(layers), steps, -1).mean(1)
                        for key in (name, "oracle", "oracle_free")]  # [L, H] each: mass averaged over steps
            rows.append({"method": name, "block_tokens": b, "budget_fraction": f"1/{frac}", "budget": context // frac,
                         **mass_row(*per_case, layers)})
    return {"context": context, "steps": steps, "layers": len(layers), "kv_heads": keys_all[0].shape[1],
            "sink_tokens": SINK_TOKENS, "recent_tokens": "store" if recent_tokens is None else recent_tokens,
            "rows": rows, "certificate": certificate, "cascade": cascade_rows}


def mass_row(per: torch.Tensor, oracle: torch.Tensor, free: torch.Tensor, layers: list[int]) -> dict:
    """One method's row from its mass, the oracle's and oracle_free's, each [L, H] averaged over the steps."""
    ratio, free_ratio = per / oracle, per / free
    worst = int(ratio.argmin())
    return {"mean_mass": float(per.mean()), "worst_mass": float(per.min()),
            "mean_vs_oracle": float(ratio.mean()), "worst_vs_oracle": float(ratio.min()),
            "worst_layer_head": [layers[worst // per.shape[1]], worst % per.shape[1]],
            "worst_layer_vs_oracle": float(ratio.mean(1).min()),
            "mean_vs_free_oracle": float(free_ratio.mean()),
            "worst_layer_vs_free_oracle": float(free_ratio.mean(1).min()),
            "worst_free_layer": layers[int(free_ratio.mean(1).argmin())]}


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
    lines = ["| method | block | budget | mean mass | worst mass | mean vs oracle | worst vs oracle | worst layer vs "
             "oracle | mean vs oracle_free | worst layer vs oracle_free |", "|" + "---|" * 10]
    for r in sorted(result["rows"], key=lambda r: (r["block_tokens"], -r["budget"], r["method"])):
        lines.append(f"| {r['method']} | {r['block_tokens']} | {r['budget_fraction']} | {r['mean_mass']:.3f} | "
                     f"{r['worst_mass']:.3f} | {r['mean_vs_oracle']:.3f} | {r['worst_vs_oracle']:.3f} | "
                     f"{r['worst_layer_vs_oracle']:.3f} | {r['mean_vs_free_oracle']:.3f} | "
                     f"{r['worst_layer_vs_free_oracle']:.3f} (layer {r['worst_free_layer']}) |")
    lines += ["", "| selector | block | budget | cases | certified < true | mean true omitted | mean certified | "
              "ratio of means | median ratio | p90 ratio |", "|" + "---|" * 10]
    for c in sorted(result["certificate"], key=lambda c: (c["selector"], c["block_tokens"], c["budget_fraction"])):
        lines.append(f"| {c['selector']} | {c['block_tokens']} | {c['budget_fraction']} | {c['cases']} | "
                     f"{c['below_true']} | "
                     f"{c['mean_true']:.4f} | {c['mean_certified']:.4f} | {c['ratio_of_means']:.2f} | "
                     f"{c['median_ratio']:.2f} | {c['p90_ratio']:.2f} |")
    lines += ["", "| cascade | block | budget | c | tau | mean s | max s | every survivor a candidate |",
              "|" + "---|" * 8]
    for c in sorted(result.get("cascade", []), key=lambda c: (c["method"], c["block_tokens"], c["budget_fraction"])):
        lines.append(f"| {c['method']} | {c['block_tokens']} | {c['budget_fraction']} | {c['candidate_factor']} | "
                     f"{c['tau']} | "
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
    parser.add_argument("--candidate-factors", default="4",
                        help="cascade: candidates = factor x k, one cascade per comma-separated factor")
    parser.add_argument("--recent-tokens", default=str(RECENT_TOKENS),
                        help="recent window protected inside the budget, or 'store': the default Config's")
    parser.add_argument("--tau", type=float, default=0.05, help="cascade: the threshold's token weight")
    parser.add_argument("--fractions", default=",".join(map(str, FRACTIONS)), help="budgets: context / each")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    t0 = time.time()
    factors = tuple(int(f) for f in args.candidate_factors.split(","))
    result = run(args.qk, args.methods.split(",") if args.methods else None,
                 tuple(int(b) for b in args.blocks.split(",")), tuple(int(f) for f in args.fractions.split(",")),
                 sketch=SketchTopK(channel_pairs=args.channel_pairs),
                 cascade=CascadeTopK(candidate_factor=factors[0], tau=args.tau), candidate_factors=factors,
                 recent_tokens=None if args.recent_tokens == "store" else int(args.recent_tokens))
    result["channel_pairs"] = args.channel_pairs
    result["seconds"] = time.time() - t0
    print(table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
