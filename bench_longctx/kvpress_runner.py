"""kvpress (NVIDIA's KV-cache compression presses) on the quality and passkey benches' own token ids.

kvpress pins an older transformers than kvtier's, so it runs in a virtual environment of its own:
this file is a script for that environment's python (stdlib, torch, transformers and kvpress only;
nothing of kvtier), and the kvtier side imports the stdlib half of it (the request format and `run`).

    python bench_longctx/kvpress_runner.py REQUEST.json [RESULT.json]   # '-' or nothing: stdin / stdout

Request (JSON): model_gguf (path of the GGUF), threads, presses (names in PRESSES) and budgets (tokens
kept of the compressed part); perplexity: {prefix_ids, scored_ids} or null; passkey: a list of
{context_ids, question_ids, key: anything echoed back} or []; max_new_tokens.
Result: perplexity rows {press, budget, compression_ratio, kept_tokens, ppl} with a dense row (press
"dense", budget null) from the same code; passkey rows {key, press, budget, kept_tokens, answer_ids}.

A press compresses the KV cache of what one prefill call writes (the prefix, or a passkey prompt's
context); the tokens after it (the scored continuation, the question and the answer) are appended
uncompressed, as kvpress's own pipeline does. compression_ratio = 1 - (budget + 0.5) / length: kvpress
keeps int(length * (1 - ratio)) tokens, and the half token keeps float rounding from dropping one.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

# bench name -> kvpress class (each one scores tokens itself, so it runs under sdpa attention)
PRESSES: dict[str, str] = {
    "snapkv": "SnapKVPress",
    "expected_attention": "ExpectedAttentionPress",
    "knorm": "KnormPress",
    "streaming_llm": "StreamingLLMPress",
    "tova": "TOVAPress",
    "random": "RandomPress",
}
# the runner's environment: nothing downloads, no progress bars in the stderr a failure reports
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
       "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1"}


def check_presses(section: str, presses: str) -> None:
    """ValueError unless presses names distinct presses of PRESSES, comma-separated."""
    names = presses.split(",")
    if not set(names) <= set(PRESSES) or len(set(names)) != len(names):
        raise ValueError(f"{section}.kvpress_presses must be distinct names from {sorted(PRESSES)}, "
                         f"comma-separated, got {presses!r}")


def check_python(section: str, python: str) -> None:
    """ValueError unless python is empty (kvpress off) or an executable file."""
    if python and not (Path(python).is_file() and os.access(python, os.X_OK)):
        raise ValueError(f"{section}.kvpress_python must be the python of a virtual environment with kvpress "
                         f"installed (e.g. /path/to/kvpress-venv/bin/python), got {python!r}: no such executable")


def request(model_gguf: str, presses: list[str], budgets: list[int], *, threads: int = 1,
            prefix_ids: list[int] | None = None, scored_ids: list[int] | None = None,
            passkey: list[dict] = (), max_new_tokens: int = 6) -> dict:
    """A runner request; ValueError for an unknown press or a budget that compresses nothing."""
    check_presses("request", ",".join(presses))
    perplexity = None
    if prefix_ids is not None:
        if len(scored_ids or ()) < 2:
            raise ValueError(f"perplexity needs at least 2 scored tokens, got {len(scored_ids or ())}")
        if not all(0 < b < len(prefix_ids) for b in budgets):
            raise ValueError(f"budgets must lie in (0, {len(prefix_ids)}) (the prefix), got {budgets}")
        perplexity = {"prefix_ids": list(prefix_ids), "scored_ids": list(scored_ids)}
    return {"model_gguf": str(model_gguf), "threads": threads, "presses": list(presses), "budgets": list(budgets),
            "perplexity": perplexity, "passkey": [dict(p) for p in passkey], "max_new_tokens": max_new_tokens}


def run(python: str, req: dict, timeout_s: float = 3600.0) -> dict:
    """The runner's result for req, run by `python` (kvpress's environment); RuntimeError with its stderr."""
    check_python("kvpress", python)
    # -I: neither PYTHONPATH nor this file's folder (kvtier's modules) on the runner's sys.path
    try:
        proc = subprocess.run([python, "-I", str(Path(__file__).resolve()), "-", "-"], input=json.dumps(req),
                              env={**os.environ, **ENV}, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"kvpress runner ({python}) ran past {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"kvpress runner ({python}) exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


# ---- below: runs inside kvpress's environment ------------------------------------------------------------


def load(model_gguf: str):
    """SmolLM2 (or any Llama-family GGUF) as a transformers model in fp32, eval mode, sdpa attention."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model_gguf)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    return model.eval()


def make_press(name: str, budget: int | None, length: int):
    """The press `name` keeping `budget` of `length` tokens, or None (dense) when budget is None."""
    if budget is None:
        return None
    import kvpress

    return getattr(kvpress, PRESSES[name])(compression_ratio=1 - (budget + 0.5) / length)


def prefill(model, ids: list[int], press):
    """(cache, last logits [vocab]) after one forward over ids, the press compressing each layer's cache."""
    import contextlib

    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad(), press(model) if press is not None else contextlib.nullcontext():
        out = model(input_ids=torch.tensor([ids]), past_key_values=cache, logits_to_keep=1)
    return cache, out.logits[0, -1].float()


def extend(model, cache, ids: list[int], start: int):
    """Logits [len(ids), vocab] of ids appended to cache at positions start.. (uncompressed)."""
    import torch

    position_ids = torch.arange(start, start + len(ids))[None]
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), past_key_values=cache, position_ids=position_ids)
    return out.logits[0].float()


def perplexity_rows(model, presses: list[str], budgets: list[int], prefix: list[int], scored: list[int]) -> list:
    """Teacher-forced perplexity of scored after prefix, dense then per press and budget."""
    import torch.nn.functional as F
    import torch

    rows = []
    for name, budget in [("dense", None)] + [(p, b) for p in presses for b in budgets]:
        press = make_press(name, budget, len(prefix))
        cache, last = prefill(model, prefix, press)
        kept = cache.get_seq_length()
        logits = torch.cat([last[None], extend(model, cache, scored[:-1], len(prefix))])  # [len(scored), vocab]
        nll = float(F.cross_entropy(logits, torch.tensor(scored)))
        rows.append({"press": name, "budget": budget, "kept_tokens": kept, "ppl": math.exp(nll),
                     "compression_ratio": press.compression_ratio if press is not None else 0.0})
    return rows


def answer(model, context: list[int], question: list[int], press, max_new_tokens: int) -> tuple[int, list[int]]:
    """(tokens kept of the context, greedy answer ids): the context compressed, the question and answer not."""
    cache, _ = prefill(model, context, press)
    kept = cache.get_seq_length()
    logits = extend(model, cache, question, len(context))[-1]
    ids = [int(logits.argmax())]
    for i in range(max_new_tokens - 1):
        ids.append(int(extend(model, cache, ids[-1:], len(context) + len(question) + i)[-1].argmax()))
    return kept, ids


def passkey_rows(model, presses: list[str], budgets: list[int], prompts: list[dict], max_new_tokens: int) -> list:
    rows = []
    for prompt in prompts:
        context, question = prompt["context_ids"], prompt["question_ids"]
        for name, budget in [("dense", None)] + [(p, b) for p in presses for b in budgets if b < len(context)]:
            kept, ids = answer(model, context, question, make_press(name, budget, len(context)), max_new_tokens)
            rows.append({"key": prompt.get("key"), "press": name, "budget": budget, "kept_tokens": kept,
                         "answer_ids": ids})
    return rows


def serve(req: dict) -> dict:
    """The result of one request (in kvpress's environment)."""
    import importlib.metadata

    import torch

    start = time.perf_counter()
    torch.set_num_threads(int(req.get("threads") or torch.get_num_threads()))
    model = load(req["model_gguf"])
    presses, budgets = req["presses"], req["budgets"]
    out: dict = {"versions": {m: importlib.metadata.version(m) for m in ("kvpress", "transformers", "torch")}}
    if req.get("perplexity"):
        p = req["perplexity"]
        out["perplexity"] = perplexity_rows(model, presses, budgets, p["prefix_ids"], p["scored_ids"])
    if req.get("passkey"):
        out["passkey"] = passkey_rows(model, presses, budgets, req["passkey"], req.get("max_new_tokens", 6))
    out["wall_s"] = time.perf_counter() - start
    return out


def main(argv: list[str]) -> int:
    if len(argv) > 2 or any(a in ("-h", "--help") for a in argv):
        print(__doc__, file=sys.stderr)
        return 2
    source = argv[0] if argv else "-"
    req = json.load(sys.stdin) if source == "-" else json.loads(Path(source).read_text())
    result = json.dumps(serve(req)) + "\n"
    if len(argv) == 2 and argv[1] != "-":
        Path(argv[1]).write_text(result)
    else:
        sys.stdout.write(result)
    return 0


if __name__ == "__main__":
    os.environ.update(ENV)
    raise SystemExit(main(sys.argv[1:]))
