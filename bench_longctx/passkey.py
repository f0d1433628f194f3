"""`kvtier bench needle` (SmolLM2 part): passkey retrieval accuracy per mode and budget.

Prompts and answer parsing come from engine_adapter.evaluate (Mohtashami & Jaggi's
passkey task). Each prompt is prefilled once into an all-fp16 store; every (mode,
budget) cell then answers on its own fork of that sequence, so modes differ only in
which blocks their decode steps attend.
"""

from __future__ import annotations

import random

import torch

from bench_longctx.models import Models, model_store
from bench_longctx.presets import PasskeyPreset
from bench_longctx.timing import Deadline, release
from engine_adapter.evaluate import passkey_prompt, read_passkey
from engine_adapter.decoder import Decoder

MAX_NEW_TOKENS = 6


def cells_for(ctx: int, budgets: tuple[int, ...]) -> list[tuple[str, int]]:
    return [("dense", ctx)] + [(mode, b) for mode in ("topk", "h2o", "window") for b in budgets if b < ctx]


def answers(decoder: Decoder, tokenizer, prompt_ids: list[int], cells: list[tuple[str, int]],
            chunk_tokens: int = 512) -> list[str | None]:
    """Prefill once; per (mode, budget) cell, the passkey read from a greedy answer on a fork."""
    base = decoder.store.create_sequence()
    try:
        logits = decoder.prefill(base, prompt_ids, chunk_tokens)
        out = []
        for mode, budget in cells:
            seq = decoder.fork(base)
            try:
                ids = decoder.continue_greedy(seq, logits, MAX_NEW_TOKENS, mode, budget)
            finally:
                decoder.free(seq)
            out.append(read_passkey(tokenizer.decode(ids)))
        return out
    finally:
        decoder.free(base)


def accuracy(rows: list[dict]) -> list[dict]:
    """Per (context, mode, budget): correct answers over depths."""
    table: dict[tuple, list[bool]] = {}
    for r in rows:
        table.setdefault((r["context"], r["mode"], r["budget"]), []).append(r["correct"])
    return [{"context": c, "mode": m, "budget": b, "accuracy": sum(v) / len(v), "prompts": len(v)}
            for (c, m, b), v in table.items()]


def run_context(models: Models, ctx: int, p: PasskeyPreset, device: torch.device) -> list[dict]:
    model, tokenizer = models.smollm2()
    store = model_store(model.args.spec, device, hot_tokens=ctx + 256, warm_tokens=0, sink_tokens=p.sink_tokens,
                        recent_tokens=p.recent_tokens)
    rng = random.Random(ctx)
    rows = []
    try:
        decoder = Decoder(model, store)
        cells = cells_for(ctx, p.budgets)
        for depth in p.depths:
            passkey = f"{rng.randrange(10000, 100000)}"
            got = answers(decoder, tokenizer, passkey_prompt(tokenizer, ctx, depth, passkey), cells)
            rows += [{"context": ctx, "depth": depth, "mode": m, "budget": b if m != "dense" else None,
                      "passkey": passkey, "answer": a, "correct": a == passkey} for (m, b), a in zip(cells, got)]
    finally:
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
    return {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized, fp32)", "depths": list(p.depths),
            "sink_tokens": p.sink_tokens, "recent_tokens": p.recent_tokens, "accuracy": accuracy(rows),
            "rows": rows, "skipped_contexts_time_budget": skipped}
