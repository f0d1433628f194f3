"""`kvtier bench quality`: perplexity deltas of int8 warm blocks and of each sparse mode (SmolLM2-135M).

Two measurements on natural text (bench_longctx.real_qk.real_text: tests/data/prose.txt, a short
story, then Python's reference documentation when more tokens are asked for):
  prefill  engine_adapter.evaluate.perplexity over the first `prefill_tokens` tokens, in a
           store that keeps everything fp16 and in one whose blocks older than
           `int8_hot_tokens` are int8 (KIVI) in the warm tier: the cost of int8 warm.
  decode   after prefilling `prefix_tokens`, the next `scored_tokens` tokens are fed one
           decode step at a time (teacher forcing) and scored, per mode and budget, each
           on its own fork of the prefill; deltas are against dense fp16 over the same
           positions. Dense and top-K also run over the int8 store (kvtier's real setup).
           Per extra recent window (`recent_tokens` after the first) the sparse modes run
           again in an fp16 store with that Config.recent_tokens, holding a copy of the prefill.
  kvpress  with `kvpress_python` set, kvpress's presses score the same prefix and tokens at the same
           budgets in that environment (bench_longctx/kvpress_runner.py), beside a dense row of its own.
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F

from bench_longctx import kvpress_runner
from bench_longctx.timing import Deadline, release
from bench_longctx.models import MODEL, Models, copy_sequence, model_store
from bench_longctx.presets import QualityPreset
from bench_longctx.real_qk import PROSE, capture, real_text
from bench_longctx.selection_quality import evaluate
from engine_adapter.evaluate import perplexity
from engine_adapter.decoder import Decoder
from engine_adapter.weights import find_gguf


def decode_nll(decoder: Decoder, seq: int, logits: torch.Tensor, targets: list[int], mode: str, budget: int) -> float:
    """Summed NLL of targets, teacher-forced: logits [vocab] predict targets[0], each step the next."""
    total = float(F.cross_entropy(logits[None], torch.tensor(targets[:1], device=logits.device)))
    for prev, target in zip(targets[:-1], targets[1:]):
        step = decoder.decode_step(seq, prev, mode, budget)
        total += float(F.cross_entropy(step[None], torch.tensor([target], device=step.device)))
    return total


def perplexity_rows(decoder: Decoder, base: int, logits: torch.Tensor, targets: list[int],
                    cells: list[tuple[str, int]]) -> list[dict]:
    """Per (mode, budget) cell, the teacher-forced perplexity of targets on a fork of base (logits: its last)."""
    rows = []
    for mode, budget in cells:
        seq = decoder.fork(base)
        try:
            ppl = math.exp(decode_nll(decoder, seq, logits, targets, mode, budget) / len(targets))
        finally:
            decoder.free(seq)
        rows.append({"mode": mode, "budget": budget if mode != "dense" else None, "ppl": ppl,
                     "recent_tokens": decoder.store.config.recent_tokens,
                     "window_tokens": decoder.store.decode.recent_window(budget) if mode != "dense" else None})
    return rows


def decode_perplexities(decoder: Decoder, prefix: list[int], targets: list[int], cells: list[tuple[str, int]],
                        windows: list[Decoder] = ()) -> list[dict]:
    """Prefill prefix once in decoder's store and score every cell there; the sparse cells again in each of
    `windows` (stores differing only in Config.recent_tokens), over a copy of the prefill."""
    base = decoder.store.create_sequence()
    try:
        logits = decoder.prefill(base, prefix)
        rows = perplexity_rows(decoder, base, logits, targets, cells)
        for other in windows:
            seq = copy_sequence(decoder.store, base, other.store)
            try:
                rows += perplexity_rows(other, seq, logits, targets, [c for c in cells if c[0] != "dense"])
            finally:
                other.free(seq)
        return rows
    finally:
        decoder.free(base)


def stores(spec, p: QualityPreset, device: torch.device, tokens: int) -> dict:
    """'fp16': every block hot; 'int8_warm': all but the sinks and the last int8_hot_tokens are int8 (both at the
    first recent window); 'fp16_recent<w>': fp16 at each further window w."""
    def fp16(recent: int):
        return model_store(spec, device, hot_tokens=tokens + 256, warm_tokens=0, sink_tokens=p.sink_tokens,
                           recent_tokens=recent)

    first, *more = p.recent_tokens
    return {"fp16": fp16(first), **{f"fp16_recent{w}": fp16(w) for w in more},
            "int8_warm": model_store(spec, device, hot_tokens=p.int8_hot_tokens, warm_tokens=tokens + 256,
                                     sink_tokens=p.sink_tokens, recent_tokens=first)}


def run_quality(p: QualityPreset, device: torch.device, models: Models, deadline: Deadline, progress) -> dict:
    note = models.note() or (None if PROSE.is_file() else f"quality skipped: {PROSE} not found")
    if note:
        return {"skipped": note}
    model, tokenizer = models.smollm2()
    ids = real_text(tokenizer, max(p.prefill_tokens, p.prefix_tokens + p.scored_tokens + 1))
    n = min(p.prefill_tokens, len(ids))
    prefix_len = min(p.prefix_tokens, len(ids) - p.scored_tokens - 1)
    prefix, targets = ids[:prefix_len], ids[prefix_len: prefix_len + p.scored_tokens]
    built = stores(model.args.spec, p, device, max(n, prefix_len + len(targets)))
    try:
        decoders = {name: Decoder(model, store) for name, store in built.items()}
        prefill = {name: perplexity(decoders[name], ids[:n])
                   for name in progress(["fp16", "int8_warm"], "quality prefill")}
        dense = ("dense", prefix_len + len(targets))
        cells = {"fp16": [dense] + [(m, b) for m in p.modes.split(",") for b in p.budgets],
                 "int8_warm": [dense] + [("topk", b) for b in p.budgets]}
        windows = [dec for name, dec in decoders.items() if name.startswith("fp16_recent")]
        rows = []
        for name in progress(list(cells), "quality decode"):
            if deadline.expired():
                break
            rows += [{"store": name, **r} for r in decode_perplexities(decoders[name], prefix, targets, cells[name],
                                                                       windows if name == "fp16" else [])]
    finally:
        for store in built.values():
            store.close()
        release(device)
    selection = selection_quality(p, models, progress) if not deadline.expired() else {"skipped": "time budget"}
    reference = next((r["ppl"] for r in rows if r["store"] == "fp16" and r["mode"] == "dense"), None)
    for r in rows:
        r["delta_vs_dense_fp16"] = None if reference is None else r["ppl"] - reference
        r["relative_delta"] = None if reference is None else r["ppl"] / reference - 1
    kvpress = {"skipped": "quality.kvpress_python is empty"}
    if p.kvpress_python:
        expired = deadline.expired()
        kvpress = {"skipped": "time budget"} if expired else kvpress_perplexity(p, prefix, targets, reference)
        rows += kvpress.pop("rows", [])
    return {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized, fp32)", "text": f"{PROSE.name} + pydoc topics",
            "text_tokens": len(ids), "sink_tokens": p.sink_tokens, "recent_tokens": list(p.recent_tokens),
            "prefill": {"tokens": n, "fp16_ppl": prefill["fp16"], "int8_warm_ppl": prefill["int8_warm"],
                        "int8_hot_tokens": p.int8_hot_tokens, "delta": prefill["int8_warm"] - prefill["fp16"],
                        "relative_delta": prefill["int8_warm"] / prefill["fp16"] - 1},
            "decode": {"prefix_tokens": prefix_len, "scored_tokens": len(targets), "rows": rows},
            "kvpress": kvpress, "selection": selection}


def kvpress_perplexity(p: QualityPreset, prefix: list[int], targets: list[int], reference: float | None) -> dict:
    """kvpress's presses over the same prefix and targets at the budgets below the prefix, run by
    p.kvpress_python: rows labelled `kvpress:<press>` (deltas against kvpress's own dense row), and that dense
    row's perplexity beside kvtier's dense fp16. A failure is recorded, kvtier's rows stay."""
    budgets = [b for b in p.budgets if b < len(prefix)]
    try:
        req = kvpress_runner.request(str(find_gguf(MODEL)), p.kvpress_presses.split(","), budgets,
                                     threads=torch.get_num_threads(), prefix_ids=prefix, scored_ids=targets)
        got = kvpress_runner.run(p.kvpress_python, req)
    except (RuntimeError, ValueError, OSError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    dense = next(r["ppl"] for r in got["perplexity"] if r["press"] == "dense")
    rows = [{"store": "kvpress", "mode": f"kvpress:{r['press']}", "budget": r["budget"], "ppl": r["ppl"],
             "kept_tokens": r["kept_tokens"], "compression_ratio": r["compression_ratio"], "window_tokens": None,
             "delta_vs_own_dense": r["ppl"] - dense, "relative_vs_own_dense": r["ppl"] / dense - 1}
            for r in got["perplexity"]]
    return {"python": p.kvpress_python, "versions": got["versions"], "wall_s": got["wall_s"], "dense_ppl": dense,
            "kvtier_dense_fp16_ppl": reference, "dense_difference": None if reference is None else dense - reference,
            "rows": rows}


def selection_quality(p: QualityPreset, models: Models, progress) -> dict:
    """Mass the top-K selectors keep vs the oracle per layer-head, on real SmolLM2 Q/K (quest, sketch and the
    store's cascade at each candidate factor), and the certified omitted mass checked against the true one on
    every case (bench_longctx/selection_quality.py)."""
    if not p.selection_tokens:
        return {"skipped": "quality.selection_tokens=0"}
    model, tokenizer = models.smollm2()
    ids = real_text(tokenizer, p.selection_tokens + p.selection_steps)
    keys, queries = capture(model, ids, p.selection_steps)
    return evaluate(keys, queries, ["quest", "sketch", "cascade_raw"], p.selection_blocks, p.selection_fractions,
                    progress=progress, candidate_factors=p.selection_candidate_factors)
