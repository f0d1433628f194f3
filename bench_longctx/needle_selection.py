"""Which selectors find the planted needles of `kvtier bench needle`, compared at the policy level (no store).

    python -m bench_longctx.needle_selection [--seeds 2] [--contexts 4096,16384,32768] [--budgets 256,1024]
        [--device cuda] [--out results.json]

The haystacks of bench_longctx/needle.py (SmolLM2-distributed background keys, norm-matched needles at graded
margins, smollm2-135m geometry, 32-token blocks, 64 sink + 128 recent tokens); per needle query each selector
picks blocks at each budget. A (needle, q head) holding >= 5% of the dense weight is a trial; it is found when
its block is selected for its kv head. Also the share of the needles' dense weight the selections hold.
Selectors: quest (TopK), sketch (SketchTopK), cascade (CascadeTopK in the haystack's PCA basis, 4 x k candidates;
_c16: 16 x k), cascade_raw (CascadeTopK on raw channels, 4 x k; cascade_raw_c16: the store's mode="cascade").
Numbers: BENCHMARKS.md, Selection quality.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from bench_longctx.needle import haystack
from bench_longctx.presets import NeedlePreset
from eviction.cascade import CascadeTopK, pca_basis, rotate_keys
from eviction.policy import ScoreContext
from eviction.select import SeqWindow
from eviction.sketch import sketch_keys
from eviction.sketch_topk import SketchTopK
from eviction.topk import TopK
from kvstore.config import ModelSpec


def selectors(keys: torch.Tensor, window: SeqWindow, block_tokens: int) -> dict[str, Callable]:
    """name -> f(q [Hq, D], budget) -> selected [H, k], over one haystack's keys [T, H, D]."""
    summaries, codes = sketch_keys(keys, block_tokens)
    basis = pca_basis(keys)
    rotated = sketch_keys(rotate_keys(keys, basis), block_tokens)
    raw = lambda q: ScoreContext(summaries, window, q=q, sketch=codes)  # noqa: E731
    turned = lambda q: ScoreContext(*rotated[:1], window, q=q, sketch=rotated[1])  # noqa: E731
    return {"quest": lambda q, b: TopK().select(raw(q), b),
            "sketch": lambda q, b: SketchTopK().select(raw(q), b),
            "cascade": lambda q, b: CascadeTopK(basis=basis, candidate_factor=4).select(turned(q), b),
            "cascade_c16": lambda q, b: CascadeTopK(basis=basis, candidate_factor=16).select(turned(q), b),
            "cascade_raw": lambda q, b: CascadeTopK(candidate_factor=4).select(raw(q), b),
            "cascade_raw_c16": lambda q, b: CascadeTopK(candidate_factor=16).select(raw(q), b)}


def run(contexts: tuple[int, ...], seeds: int, p: NeedlePreset = NeedlePreset(),
        device: torch.device | str = "cpu") -> list[dict]:
    """Rows per (context, budget, selector): found / trials, recall, needle weight held."""
    spec = ModelSpec.preset(p.geometry)
    acc: dict = {}
    for ctx in contexts:
        window = SeqWindow(num_tokens=ctx, block_tokens=p.block_tokens, sink_tokens=p.sink_tokens,
                           recent_tokens=p.recent_tokens)
        for seed in range(seeds):
            hay = haystack(spec, ctx, p, torch.device(device), seed=seed)
            group = spec.num_q_heads // spec.num_kv_heads
            for name, select in selectors(hay["keys"], window, p.block_tokens).items():
                for budget in p.budgets:
                    for q, pos, weight in zip(hay["queries"], hay["positions"], hay["weights"]):  # weight [Hq]
                        found = (select(q, budget) == pos // p.block_tokens).any(1).repeat_interleave(group)
                        trial = weight >= p.min_weight
                        a = acc.setdefault((ctx, budget, name), [0, 0, 0.0, 0.0])
                        a[0] += int((found & trial).sum())
                        a[1] += int(trial.sum())
                        a[2] += float((weight.float() * found).sum())
                        a[3] += float(weight.float().sum())
    return [{"context": c, "budget": b, "selector": n, "found": f, "trials": t, "recall": f / max(t, 1),
             "weight_held": m / max(w, 1e-12)} for (c, b, n), (f, t, m, w) in sorted(acc.items())]


def table(rows: list[dict]) -> str:
    names = sorted({r["selector"] for r in rows})
    lines = ["| context | budget | " + " | ".join(f"{n}: recall, weight" for n in names) + " |",
             "|" + "---|" * (2 + len(names))]
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["context"], r["budget"]), {})[r["selector"]] = r
    for (c, b), by in sorted(cells.items()):
        lines.append(f"| {c} | {b} | " + " | ".join(f"{by[n]['found']}/{by[n]['trials']}, {by[n]['weight_held']:.3f}"
                                                    for n in names) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="4096,16384,32768")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--budgets", default=",".join(map(str, NeedlePreset().budgets)))
    parser.add_argument("--device", default="cpu", help="cuda: Quest and the sketch run their GPU kernels")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    preset = NeedlePreset(budgets=tuple(int(b) for b in args.budgets.split(",")))
    rows = run(tuple(int(c) for c in args.contexts.split(",")), args.seeds, preset, args.device)
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
