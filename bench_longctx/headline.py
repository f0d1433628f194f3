"""The README's benchmark table: headline numbers of one or more `kvtier bench` runs.

    python -m bench_longctx.headline DIR/results.json [more results.json ...]

Each row puts a kvtier number next to its baseline from the same run; the header names
the device, date and command. Rows whose suite did not run are left out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench_longctx.report import fmt, md_table


def _largest(rows: list[dict], key: str = "context") -> list[dict]:
    top = max((r[key] for r in rows), default=None)
    return [r for r in rows if r[key] == top]


def e2e_rows(s: dict) -> list[list]:
    e, p = s.get("e2e", {}), s.get("e2e", {}).get("paths", {})
    rows = []
    where = f"{e.get('geometry')} greedy decode, {fmt(e.get('context'))} context"
    for kind, how in (("graph", "one CUDA graph per token, every token appended"),
                      ("eager", "eager launches, every token appended")):
        for mode, what in (("topk", "top-K (Quest bound)"), ("sketch", "top-K (4-bit key sketch)")):
            top, dense = p.get(f"{kind}_{mode}"), p.get(f"{kind}_dense")
            if top and dense and "error" not in top and "error" not in dense:
                rows.append([f"{where}, {what} {e.get('budget')} ({how})", f"{fmt(top['tokens_per_s'])} tok/s",
                             f"dense int8: {fmt(dense['tokens_per_s'])} tok/s"])
    return rows


def decode_rows(s: dict) -> list[list]:
    d = s.get("decode", {})
    measured = [r for r in d.get("rows", []) if "modes" in r]
    rows = []
    for r in _largest(measured):
        m, sdpa = r["modes"], r["modes"]["sdpa"]
        for name in [k for k in m if k.startswith("topk_") and k.endswith("graphed")] or \
                [k for k in m if k.startswith("topk_")][:1]:
            rows.append([f"layer step, {fmt(r['context'])} tokens, {name}", f"{fmt(m[name]['ms'])} ms "
                         f"({fmt(m[name]['speedup_vs_sdpa'])}x)", f"SDPA dense fp16: {fmt(sdpa['ms'])} ms"])
        for name in ("kvtier_dense", "kvtier_int8"):
            rows.append([f"layer step, {fmt(r['context'])} tokens, {name}", f"{fmt(m[name]['ms'])} ms "
                         f"({fmt(m[name]['of_copy_ceiling'])} of copy ceiling)", f"SDPA: {fmt(sdpa['ms'])} ms"])
    return rows


def needle_rows(s: dict) -> list[list]:
    syn = s.get("needle", {}).get("synthetic", {})
    rows = []
    here = _largest(syn.get("rows", []))
    dense = next((r["recall"] for r in here if r["mode"] == "dense"), None)
    widest = max((r["budget"] for r in here if r["budget"]), default=None)
    for r in here:
        if r["mode"] == "topk" or (r["mode"] in ("window", "h2o") and r["budget"] == widest):
            rows.append([f"needle recall, {fmt(r['context'])} tokens, {r['mode']} {r['budget']}", fmt(r["recall"]),
                         f"dense: {fmt(dense)}"])
    pk = s.get("needle", {}).get("passkey", {})
    acc = _largest(pk.get("accuracy", []))
    dense_pk = next((a["accuracy"] for a in acc if a["mode"] == "dense"), None)
    rows += [[f"SmolLM2 passkey, {fmt(a['context'])} tokens, {a['mode']} {a['budget']}", fmt(a["accuracy"]),
              f"dense: {fmt(dense_pk)}"] for a in acc if a["mode"] == "topk"]
    return rows


def other_rows(s: dict) -> list[list]:
    rows = []
    for m in s.get("tiers", {}).get("moves", []):
        if m["move"].startswith(("cpu -> device batched", "ssd read, zstd-split", "hot -> warm")):
            rows.append([m["move"], f"{fmt(m['GBps'])} GB/s", f"{m['ceiling']}: {fmt(m['ceiling_GBps'])} GB/s"])
    q = s.get("quality", {})
    if "prefill" in q:
        p = q["prefill"]
        rows.append([f"perplexity, int8 warm ({p['tokens']} tokens)", fmt(p["int8_warm_ppl"]),
                     f"fp16: {fmt(p['fp16_ppl'])}"])
    return rows


def headline(results: dict) -> str:
    env, s = results["environment"], results["suites"]
    rows = e2e_rows(s) + decode_rows(s) + needle_rows(s) + other_rows(s)
    title = (f"**{env['device_name']}**, {env['date'][:10]}, preset `{results['preset']['name']}` "
             f"(`{env['command']}`, {results['wall_s']:.0f} s)")
    return title + "\n\n" + md_table(["measure", "kvtier", "baseline, same run"], rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(headline(json.loads(Path(p).read_text())) for p in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
