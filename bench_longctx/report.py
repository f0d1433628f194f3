"""What a `kvtier bench` run leaves behind: results.json, readable tables (printed and summary.md)
and PNG plots (bench_longctx.plots)."""

from __future__ import annotations

import json
import math
from pathlib import Path


def fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int) and value >= 1024 and value % 1024 == 0:
        return f"{value // (1 << 20)}M" if value % (1 << 20) == 0 else f"{value // 1024}K"
    return str(value)


def md_table(headers: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def decode_table(r: dict) -> str:
    rows = [row for row in r["rows"] if "modes" in row]
    modes = list(dict.fromkeys(m for row in rows for m in row["modes"]))
    table = [[row["context"], *[row["modes"].get(m, {}).get("ms") for m in modes]] for row in rows]
    speed = [[row["context"], *[row["modes"].get(m, {}).get("speedup_vs_sdpa") for m in modes]] for row in rows]
    frac = [[row["context"], *[row["modes"].get(m, {}).get("of_copy_ceiling") for m in modes]] for row in rows]
    errors = [f"- {row['context']}: {row['error']}" for row in r["rows"] if "error" in row]
    return "\n\n".join([
        f"Decode step, one {r['geometry']} layer: ms (copy ceiling {r['copy_ceiling_GBps']:.1f} GB/s); `_per_layer`: "
        f"a token of every layer in one graph replay over a store of every layer, divided by the layers",
        md_table(["context", *modes], table), "Speedup over SDPA (same run)", md_table(["context", *modes], speed),
        "Achieved bandwidth as a fraction of the copy ceiling", md_table(["context", *modes], frac), *errors])


def needle_table(r: dict) -> str:
    parts = []
    syn = r.get("synthetic", {})
    if syn.get("rows"):
        rows = [[x["context"], x["mode"], x["budget"], x["recall"], x["mass_captured"], x["read_fraction"]]
                for x in syn["rows"]]
        parts += [f"Planted-needle recall, one {syn['geometry']} layer ({syn['needles_per_context']} needles "
                  f"per context)", md_table(["context", "mode", "budget", "recall", "mass captured", "read"], rows)]
        parts += [f"- {e['context']}: {e['error']}" for e in syn.get("errors", [])]
    parts += _skip_or_error("synthetic needle", syn)
    pk = r.get("passkey", {})
    if pk.get("accuracy"):
        rows = [[a["context"], a.get("recent_tokens"), a["mode"], a["budget"], a["accuracy"], a["prompts"]]
                for a in pk["accuracy"]]
        parts += ["SmolLM2-135M passkey accuracy",
                  md_table(["context", "recent tokens", "mode", "budget", "accuracy", "prompts"], rows)]
    parts += _skip_or_error("passkey", pk)
    if "error" in pk.get("kvpress", {}):
        parts += _skip_or_error("kvpress passkey", pk["kvpress"])
    return "\n\n".join(parts)


def tiers_table(r: dict) -> str:
    rows = [[m["move"], m["GBps"], m["ceiling"], m["ceiling_GBps"], m["of_ceiling"], m.get("ratio")]
            for m in r["moves"]]
    parts = [f"Tier moves, {r['geometry']} blocks (ceilings measured in this run)",
             md_table(["move", "GB/s", "ceiling", "ceiling GB/s", "of ceiling", "compression ratio"], rows)]
    return "\n\n".join(parts + _skip_or_error("service", r.get("service", {})))


def quality_table(r: dict) -> str:
    p = r["prefill"]
    rows = [[x["store"], x.get("window_tokens"), x["mode"], x["budget"], x["ppl"],
             x.get("delta_vs_dense_fp16", x.get("delta_vs_own_dense")),
             x.get("relative_delta", x.get("relative_vs_own_dense"))] for x in r["decode"]["rows"]]
    return "\n\n".join([
        f"Perplexity, {r['model']}, {r['text']}",
        md_table(["prefill tokens", "fp16", "int8 warm", "delta", "relative"],
                 [[p["tokens"], p["fp16_ppl"], p["int8_warm_ppl"], p["delta"], p["relative_delta"]]]),
        f"Teacher-forced decode: {r['decode']['scored_tokens']} tokens after a {r['decode']['prefix_tokens']}-token "
        "prefix", md_table(["store", "recent window", "mode", "budget", "ppl", "delta", "relative"], rows),
        *kvpress_notes(r.get("kvpress", {})), *selection_tables(r)])


def kvpress_notes(k: dict) -> list[str]:
    if "dense_ppl" not in k:
        return [] if "quality.kvpress_python" in k.get("skipped", "") else _skip_or_error("kvpress", k)
    v = k["versions"]
    return [f"- kvpress rows (kvpress {v['kvpress']}, transformers {v['transformers']}, fp32 KV): the press "
            f"keeps `budget` tokens of the prefix and the scored tokens join uncompressed; deltas are against "
            f"kvpress's own dense row, whose ppl {fmt(k['dense_ppl'])} differs from kvtier's dense fp16 "
            f"{fmt(k['kvtier_dense_fp16_ppl'])} by {fmt(k['dense_difference'])}"]


def selection_tables(r: dict) -> list[str]:
    sel = r.get("selection", {})
    if not sel.get("rows"):
        return _skip_or_error("selection", sel)
    rows = [[x["method"], x["block_tokens"], x["budget"], x["mean_mass"], x["worst_mass"], x["mean_vs_oracle"],
             x["worst_vs_oracle"]] for x in sel["rows"]]
    cert = [[c["block_tokens"], c["budget_fraction"], c["cases"], c["below_true"], c["mean_true"],
             c["mean_certified"], c["ratio_of_means"], c["median_ratio"]] for c in sel["certificate"]]
    return [f"Selected softmax mass on real SmolLM2 Q/K ({sel['context']} tokens, {sel['steps']} steps, "
            f"{sel['layers']} layers x {sel['kv_heads']} kv heads; worst = worst layer-head)",
            md_table(["method", "block", "budget", "mean mass", "worst mass", "mean vs oracle", "worst vs oracle"],
                     rows),
            "Certified omitted mass of the sketch selection vs the true omitted mass (every case checked)",
            md_table(["block", "budget", "cases", "certified < true", "true", "certified", "ratio of means",
                      "median ratio"], cert)]


def e2e_table(r: dict) -> str:
    rows = [[name, x["tokens_per_s"], x["ms_per_token"], x["steps"], x.get("appends"), x.get("appended_verified")]
            if "error" not in x else [name, f"failed: {x['error'][:120]}", None, None, None, None]
            for name, x in r["paths"].items()]
    tiers = [[name, t["blocks"], t["bytes"] / 2**30, t["capacity_bytes"] / 2**30]
             for name, t in r["memory"]["tiers"].items()]
    mem = r["memory"]
    extra = [["block index (summaries, maps, H2O, sketch codes)", None, mem["block_index_bytes"] / 2**30, None],
             ["model weights", None, mem["model_weights_bytes"] / 2**30, None]]
    if "cuda_max_allocated_bytes" in mem:
        extra.append(["CUDA max allocated", None, mem["cuda_max_allocated_bytes"] / 2**30, None])
    return "\n\n".join([
        f"Greedy decode, {r['geometry']} geometry ({r['layers']} layers, random {r['dtype']} weights), "
        f"context {fmt(r['context'])}, top-K budget {r['budget']}, fill: {r['fill']}, "
        f"warm format {r.get('warm_format', 'int8')} (cpu tier: {r.get('cpu_dtype', 'int8')})",
        md_table(["path", "tokens/s", "ms/token", "steps", "appends", "appends verified"], rows),
        md_table(["memory", "blocks", "GiB", "capacity GiB"], tiers + extra), *[f"- {n}" for n in r["notes"]]])


def _boundary_steps(x: dict) -> str | None:
    """Steady steps' p50 where a sequence opens new tail blocks / elsewhere (serve_bench.run_trace)."""
    steps = x.get("steady_step_ms")
    if not steps or not steps["opening_tails"]["steps"]:
        return None
    return f"{steps['opening_tails']['p50']:.3g} / {steps['other']['p50']:.3g}"


def serve_table(r: dict) -> str:
    head = ["store", "warm format", "mode", "requests", "tokens/s", "steady tokens/s", "TPOT p50 ms", "TPOT p99 ms",
            "steady TPOT p99 ms", "boundary / other step p50 ms", "captures", "queue mean s", "preemptions",
            "most running", "longest GC ms", "appends verified"]
    def row(name: str, x: dict) -> list:
        if "error" in x:
            return [name, f"failed: {x['error'][:160]}"] + [None] * (len(head) - 2)
        return [name, x.get("warm_format", "int8"), x["mode"], x["requests"], x["tokens_per_s"], x["steady_tokens_per_s"], x["tpot_ms_p50"],
                x["tpot_ms_p99"], x["steady_tpot_ms_p99"], _boundary_steps(x), x["graph_captures"], x["queue_s_mean"],
                x["preemptions"], x["most_running"], 1e3 * x["gc"]["longest_s"] if "gc" in x else None, x["appended_verified"]]
    parts = [f"Continuous batching, {r['geometry']} geometry ({r['layers']} layers, random weights), "
             f"{r['requests']} requests of contexts {[fmt(c) for c in r['contexts']]}, {r['output_tokens']} output "
             f"tokens each, arrival rate {r['arrival_rate'] or 'all at once'}, budget {r['budget']}",
             md_table(head, [row(name, x) for name, x in r["runs"].items()])]
    if r["sweep"]:
        parts.append(md_table(["batch", *head[1:]], [row(str(x["batch"]), x) for x in r["sweep"]]))
    if "speedup_vs_dense_fp16" in r:
        parts.append(f"kvtier / dense fp16: {r['speedup_vs_dense_fp16']:.2f}x aggregate tokens/s")
    return "\n\n".join(parts + [f"- {n}" for n in r["notes"]])


def formats_table(r: dict) -> str:
    def num(x: float | None, digits: int = 4, sign: str = "") -> str | None:
        return None if x is None else f"{x:{sign}.{digits}f}"

    ppl = [[x["format"], x["hot_tokens"], num(x["ppl"]), num(x["delta_vs_fp16"], sign="+"),
            num(x.get("past_window_ppl")), num(x.get("past_window_fp16_ppl")),
            num(x.get("past_window_delta"), sign="+"), num(x["warm_share"], 3), x["shared_tokens"], x.get("wall_s")]
           for x in r["perplexity"]]
    cells = list(dict.fromkeys((x["format"], x["hot_tokens"]) for x in r["attention"]["rows"]))
    by_layer: dict[int, dict] = {}
    for x in r["attention"]["rows"]:
        by_layer.setdefault(x["layer"], {})[(x["format"], x["hot_tokens"])] = f"{x['mean']:.2e} / {x['max']:.2e}"
    attn = [[layer, *[cols.get(c) for c in cells]] for layer, cols in sorted(by_layer.items())]
    keys = list(dict.fromkeys((x["format"], x["hot_tokens"]) for x in r["passkey"]["rows"]))
    by_depth: dict[float, dict] = {}
    for x in r["passkey"]["rows"]:
        mark = "" if x["format"] == "fp16" else (" (= fp16)" if x["as_fp16"] else " (differs)")
        row = by_depth.setdefault(x["depth"], {"needle": x["needle_position"]})
        row[(x["format"], x["hot_tokens"])] = f"{x['answer']}{' ok' if x['correct'] else ' wrong'}{mark}"
    pk = [[depth, row["needle"], *[row.get(k) for k in keys]] for depth, row in by_depth.items()]
    label = [f"{f}" if h is None else f"{f} hot {h}" for f, h in keys]
    return "\n\n".join([
        f"Perplexity per warm format, {r['model']}, {r['tokens']} tokens of {r['text']}, {r['chunk_tokens']} tokens "
        "per prefill call (each reads the earlier ones back from the store); past window = positions past the "
        "sinks and the hot window",
        md_table(["format", "hot window", "ppl", "change vs fp16", "past-window ppl", "fp16 past-window ppl",
                  "past-window change", "warm share", "shared tokens", "s"], ppl),
        f"Attention output relative error per layer, mean / max over {r['attention']['queries']} real queries x q "
        f"heads, over {r['attention']['context']} stored tokens read back from each format's store",
        md_table(["layer", *[f"{f} hot {h}" for f, h in cells]], attn),
        f"Passkey at {r['passkey']['context']} tokens, dense answers over the stored prompt (needle = its position)",
        md_table(["depth", "needle", *label], pk)])


TABLES = {"decode": decode_table, "needle": needle_table, "tiers": tiers_table, "quality": quality_table,
          "e2e": e2e_table, "serve": serve_table, "formats": formats_table}


def _skip_or_error(what: str, r: dict) -> list[str]:
    if "skipped" in r:
        return [f"- {what}: {r['skipped']}"]
    if "error" in r:
        return [f"- {what} FAILED: {r['error']}"]
    return []


def summary(results: dict) -> str:
    env = results["environment"]
    parts = [f"# kvtier bench, preset {results['preset']['name']}",
             f"{env['date']} on {env['device_name']} ({env['device']}), torch {env['torch']}; "
             f"wall {results['wall_s']:.0f} s; command: `{env['command']}`"]
    for name, r in results["suites"].items():
        parts.append(f"## {name} ({r.get('wall_s', 0):.0f} s)")
        problems = _skip_or_error(name, r)
        parts += problems if problems else [TABLES[name](r)]
    return "\n\n".join(parts) + "\n"


def write(results: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "summary.md").write_text(summary(results))
    return [out / "results.json", out / "summary.md"]
