"""`kvtier bench needle` (SmolLM2 part): passkey retrieval accuracy per mode and budget.

Prompts and answer parsing come from engine_adapter.evaluate (Mohtashami & Jaggi's
passkey task). Each prompt is prefilled once into an all-fp16 store; every (mode,
budget) cell then answers on its own fork of that sequence, so modes differ only in
which blocks their decode steps attend. Per extra recent window (`recent_tokens` after
the first) the sparse cells answer again in a store with that Config.recent_tokens,
holding a copy of the prefill. With `kvpress_python` set, kvpress's presses answer the same prompts in
that environment (bench_longctx/kvpress_runner.py): the context before the question compressed to the
budget, the question and answer not.
"""

from __future__ import annotations

import random

import torch

from bench_longctx import kvpress_runner
from bench_longctx.models import MODEL, Models, copy_sequence, model_store
from bench_longctx.presets import PasskeyPreset
from bench_longctx.timing import Deadline, release
from engine_adapter.evaluate import QUESTION, passkey_prompt, read_passkey
from engine_adapter.decoder import Decoder
from engine_adapter.weights import find_gguf

MAX_NEW_TOKENS = 6


def cells_for(ctx: int, budgets: tuple[int, ...], modes: str) -> list[tuple[str, int]]:
    return [("dense", ctx)] + [(mode, b) for mode in modes.split(",") for b in budgets if b < ctx]


def fork_answers(decoder: Decoder, tokenizer, base: int, logits: torch.Tensor,
                 cells: list[tuple[str, int]]) -> list[str | None]:
    """Per (mode, budget) cell, the passkey read from a greedy answer on a fork of base (logits: its last)."""
    out = []
    for mode, budget in cells:
        seq = decoder.fork(base)
        try:
            ids = decoder.continue_greedy(seq, logits, MAX_NEW_TOKENS, mode, budget)
        finally:
            decoder.free(seq)
        out.append(read_passkey(tokenizer.decode(ids)))
    return out


def answers(decoders: list[Decoder], tokenizer, prompt_ids: list[int], cells: list[tuple[str, int]],
            chunk_tokens: int = 512) -> list[tuple[int, str, int, str | None]]:
    """Prefill once in the first decoder's store; (recent_tokens, mode, budget, passkey read) per cell there and
    per sparse cell in each further decoder's store (differing only in Config.recent_tokens), over a copy."""
    first, *windows = decoders
    base = first.store.create_sequence()
    try:
        logits = first.prefill(base, prompt_ids, chunk_tokens)
        window = first.store.config.recent_tokens
        out = [(window, m, b, a) for (m, b), a in zip(cells, fork_answers(first, tokenizer, base, logits, cells))]
        sparse = [c for c in cells if c[0] != "dense"]
        for other in windows:
            seq = copy_sequence(first.store, base, other.store)
            try:
                got = fork_answers(other, tokenizer, seq, logits, sparse)
            finally:
                other.free(seq)
            out += [(other.store.config.recent_tokens, m, b, a) for (m, b), a in zip(sparse, got)]
        return out
    finally:
        first.free(base)


def accuracy(rows: list[dict]) -> list[dict]:
    """Per (context, recent window, mode, budget): correct answers over depths."""
    table: dict[tuple, list[bool]] = {}
    for r in rows:
        table.setdefault((r["context"], r["recent_tokens"], r["mode"], r["budget"]), []).append(r["correct"])
    return [{"context": c, "recent_tokens": w, "mode": m, "budget": b, "accuracy": sum(v) / len(v),
             "prompts": len(v)} for (c, w, m, b), v in table.items()]


def prompts(tokenizer, ctx: int, depths: tuple[float, ...]) -> list[tuple[float, str, list[int]]]:
    """(depth, passkey, prompt ids) per depth; the passkeys are seeded by ctx, the same on every run."""
    rng = random.Random(ctx)
    keys = [f"{rng.randrange(10000, 100000)}" for _ in depths]
    return [(depth, key, passkey_prompt(tokenizer, ctx, depth, key)) for depth, key in zip(depths, keys)]


def run_context(models: Models, ctx: int, p: PasskeyPreset, device: torch.device) -> list[dict]:
    model, tokenizer = models.smollm2()
    stores = [model_store(model.args.spec, device, hot_tokens=ctx + 256, warm_tokens=0, sink_tokens=p.sink_tokens,
                          recent_tokens=w) for w in p.recent_tokens]
    rows = []
    try:
        decoders = [Decoder(model, store) for store in stores]
        cells = cells_for(ctx, p.budgets, p.modes)
        for depth, passkey, prompt_ids in prompts(tokenizer, ctx, p.depths):
            got = answers(decoders, tokenizer, prompt_ids, cells)
            rows += [{"context": ctx, "depth": depth, "recent_tokens": w, "mode": m,
                      "budget": b if m != "dense" else None, "passkey": passkey, "answer": a, "correct": a == passkey}
                     for w, m, b, a in got]
    finally:
        for store in stores:
            store.close()
        release(device)
    return rows


def run_passkey(p: PasskeyPreset, device: torch.device, models: Models, deadline: Deadline, progress) -> dict:
    note = models.note()
    if note:
        return {"skipped": note}
    rows, skipped = [], []
    for ctx in progress(sorted(p.contexts), "passkey"):
        if deadline.expired():
            skipped.append(ctx)
            continue
        rows += run_context(models, ctx, p, device)
    done = [c for c in sorted(p.contexts) if c not in skipped]
    kvpress = {"skipped": "passkey.kvpress_python is empty"}
    if p.kvpress_python:
        kvpress = {"skipped": "time budget"} if deadline.expired() else kvpress_answers(p, models, done)
        rows += kvpress.pop("rows", [])
    return {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized, fp32)", "depths": list(p.depths),
            "sink_tokens": p.sink_tokens, "recent_tokens": list(p.recent_tokens), "accuracy": accuracy(rows),
            "rows": rows, "skipped_contexts_time_budget": skipped, "kvpress": kvpress}


def kvpress_answers(p: PasskeyPreset, models: Models, contexts: list[int]) -> dict:
    """kvpress's presses on the prompts of each context, run by p.kvpress_python (one process for all): rows
    labelled `kvpress:<press>` with a dense row of its own. A failure is recorded, kvtier's rows stay."""
    tokenizer = models.smollm2()[1]
    question = len(tokenizer(QUESTION, add_special_tokens=False)["input_ids"])  # a prompt's last tokens
    asked = [{"key": [ctx, depth, key], "context_ids": ids[:-question], "question_ids": ids[-question:]}
             for ctx in contexts for depth, key, ids in prompts(tokenizer, ctx, p.depths)]
    try:
        req = kvpress_runner.request(str(find_gguf(MODEL)), p.kvpress_presses.split(","), list(p.budgets),
                                     threads=torch.get_num_threads(), passkey=asked, max_new_tokens=MAX_NEW_TOKENS)
        got = kvpress_runner.run(p.kvpress_python, req)
    except (RuntimeError, ValueError, OSError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    rows = []
    for r in got["passkey"]:
        (ctx, depth, key), found = r["key"], read_passkey(tokenizer.decode(r["answer_ids"]))
        rows.append({"context": ctx, "depth": depth, "recent_tokens": None, "mode": f"kvpress:{r['press']}",
                     "budget": r["budget"], "kept_tokens": r["kept_tokens"], "passkey": key, "answer": found,
                     "correct": found == key})
    return {"python": p.kvpress_python, "versions": got["versions"], "wall_s": got["wall_s"], "rows": rows}
