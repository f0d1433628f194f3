"""PNG plots of a `kvtier bench` run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _title(results: dict, what: str) -> str:
    env = results["environment"]
    return f"{what}\n{env['device_name']}, {env['date'][:10]}, preset {results['preset']['name']}"


def latency(results: dict, r: dict, path: Path) -> Path:
    rows = [row for row in r["rows"] if "modes" in row]
    modes = list(dict.fromkeys(m for row in rows for m in row["modes"]))
    fig, ax = plt.subplots(figsize=(8, 5))
    for mode in modes:
        pts = [(row["context"], row["modes"][mode]["ms"]) for row in rows if mode in row["modes"]]
        style = "k--" if mode == "sdpa" else "-o"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=mode, markersize=4)
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms per layer step",
           title=_title(results, f"Decode step latency, one {r['geometry']} layer"))
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, path)


def recall(results: dict, r: dict, path: Path) -> Path:
    fig, axes = _vs_budget(r["rows"], "recall", ("sketch", "topk", "h2o", "window"), "needle recall")
    for ax in axes[0]:
        ax.grid(True, alpha=0.3)
    fig.suptitle(_title(results, "Planted-needle recall vs budget"), fontsize=10)
    return _save(fig, path)


def passkey(results: dict, r: dict, path: Path) -> Path:
    fig, _ = _vs_budget(r["accuracy"], "accuracy", ("topk", "h2o", "window"), "passkey accuracy")
    fig.suptitle(_title(results, "SmolLM2-135M passkey accuracy vs budget"), fontsize=10)
    return _save(fig, path)


def _vs_budget(rows: list[dict], value: str, modes: tuple[str, ...], ylabel: str) -> tuple:
    """A panel per context: rows' `value` against budget, a line per mode and dense's as a dotted level."""
    contexts = sorted({x["context"] for x in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(4 * len(contexts), 4), squeeze=False, sharey=True)
    for ax, ctx in zip(axes[0], contexts):
        here = [x for x in rows if x["context"] == ctx]
        for mode in modes:
            pts = sorted((x["budget"], x[value]) for x in here if x["mode"] == mode and x[value] is not None)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label=mode, markersize=4)
        for x in here:
            if x["mode"] == "dense":
                ax.axhline(x[value], color="gray", linestyle=":", linewidth=2, label="dense", zorder=0)
        ax.set(xscale="log", xlabel="budget (tokens)", title=f"{ctx:,} tokens", ylim=(-0.05, 1.05))
    axes[0][0].set_ylabel(ylabel)
    axes[0][0].legend(fontsize=8)
    return fig, axes


def tiers(results: dict, r: dict, path: Path) -> Path:
    moves = r["moves"]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(moves) + 1.5))
    ys = range(len(moves))
    ax.barh(list(ys), [m["GBps"] for m in moves], color="tab:blue", label="measured")
    ceil = [(y, m["ceiling_GBps"]) for y, m in zip(ys, moves) if m["ceiling_GBps"]]
    ax.scatter([c[1] for c in ceil], [c[0] for c in ceil], marker="|", s=200, color="red", label="its ceiling")
    ax.set_yticks(list(ys), [m["move"] for m in moves], fontsize=7)
    ax.invert_yaxis()
    ax.set(xscale="log", xlabel="GB/s (payload)", title=_title(results, "Tier bandwidth against measured ceilings"))
    ax.legend(fontsize=8)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    return _save(fig, path)


def e2e(results: dict, r: dict, path: Path) -> Path:
    names = [n for n, x in r["paths"].items() if "error" not in x]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(names, [r["paths"][n]["tokens_per_s"] for n in names], color="tab:green")
    ax.set(ylabel="tokens/s", title=_title(results, f"Greedy decode, {r['geometry']}, context {r['context']:,}"))
    ax.tick_params(axis="x", labelsize=8)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def make_plots(results: dict, out: Path) -> list[Path]:
    """Every plot whose suite produced data; a suite that failed or skipped just has none."""
    s, made = results["suites"], []
    if s.get("decode", {}).get("rows") and any("modes" in r for r in s["decode"]["rows"]):
        made.append(latency(results, s["decode"], out / "decode_latency_vs_context.png"))
    needle = s.get("needle", {})
    if needle.get("synthetic", {}).get("rows"):
        made.append(recall(results, needle["synthetic"], out / "needle_recall_vs_budget.png"))
    if needle.get("passkey", {}).get("accuracy"):
        made.append(passkey(results, needle["passkey"], out / "passkey_accuracy_vs_budget.png"))
    if s.get("tiers", {}).get("moves"):
        made.append(tiers(results, s["tiers"], out / "tier_bandwidth.png"))
    if s.get("e2e", {}).get("paths"):
        made.append(e2e(results, s["e2e"], out / "e2e_tokens_per_s.png"))
    return made
