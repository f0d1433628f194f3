"""Timed tokens of contexts_bench: greedy top-K decode steps, each synchronized and labelled with the path it took
(Decoder.paths: "captured" through the captured step, "eager" through store.append + store.attend).

    first_token          one step
    next_tokens          NEXT_TOKENS steps after it
    decode_while_loading the child that opened with store.open(name, background_load=True): from the token after
                         the first, until the load has ended and NEXT_TOKENS more ran (or max_tokens): eager
                         while blocks are still in the save, captured (on CUDA) once the Decoder's place_loaded
                         calls have put every block on the GPU or in the cpu tier. place_loaded's host seconds per call
                         are the pause the load adds between two tokens (for every sequence a batch decodes).
"""

from __future__ import annotations

import statistics

import torch

from bench_longctx.timing import timed, timed_calls
from engine_adapter.decoder import Decoder
from kvstore.store import KVStore

NEXT_TOKENS = 4  # decoded and timed after the first one
BUDGET = 4096  # top-K tokens a decoded token attends


def first_token(dec: Decoder, seq: int, last: int, device: str) -> tuple[torch.Tensor, float]:
    """fp32 logits [vocab] of one topk decode step after `last`, and its seconds (synchronized)."""
    logits, seconds = timed(lambda: dec.decode_step(seq, last, "topk", BUDGET), device)
    return logits.float().cpu(), seconds


def _step(dec: Decoder, seq: int, token: int, device: str) -> tuple[int, float, str]:
    """(the next greedy token, seconds, path) of one step after `token`."""
    captured = dec.paths["captured"]
    logits, seconds = first_token(dec, seq, token, device)
    return int(logits.argmax()), seconds, "captured" if dec.paths["captured"] > captured else "eager"


def next_tokens(dec: Decoder, seq: int, logits: torch.Tensor, device: str) -> dict:
    """NEXT_TOKENS greedy tokens after `logits`: each one's seconds and path."""
    seconds, paths, token = [], [], int(logits.argmax())
    for _ in range(NEXT_TOKENS):
        token, s, path = _step(dec, seq, token, device)
        seconds.append(s)
        paths.append(path)
    return {"next_tokens_s": seconds, "next_tokens_path": paths}


def decode_while_loading(dec: Decoder, store: KVStore, seq: int, logits: torch.Tensor, device: str,
                         max_tokens: int) -> dict:
    """Greedy tokens after `logits` while the background load of `seq` runs (module docstring)."""
    pauses: list[tuple[float, int]] = []
    store.place_loaded = timed_calls(store.place_loaded, pauses)  # what the Decoder calls before every token
    seconds, paths, token, after_load = [], [], int(logits.argmax()), 0
    try:
        while len(seconds) < max_tokens and after_load < NEXT_TOKENS:
            token, s, path = _step(dec, seq, token, device)
            seconds.append(s)
            paths.append(path)
            after_load += not store.loads.loading(seq)
    finally:
        del store.place_loaded  # the method again
    switch = paths.index("captured") if "captured" in paths else None
    eager = [s for s, p in zip(seconds, paths) if p == "eager"]
    return {"tokens_before_captured": switch,
            "seconds_before_captured": None if switch is None else sum(seconds[:switch]),
            "eager_tokens": len(eager), "eager_token_s_median": statistics.median(eager) if eager else 0.0,
            "last_tokens_s": seconds[-NEXT_TOKENS:], "last_tokens_path": paths[-NEXT_TOKENS:],
            "blocks_placed": sum(m for _, m in pauses), "longest_place_s": max((s for s, _ in pauses), default=0.0),
            "blocks_left_in_save": store.stats()["tiers"]["saved"]["blocks"], "still_loading": store.loads.loading(seq)}


def describe(r: dict) -> str:
    last = ", ".join(f"{t * 1e3:.1f} ({p})" for t, p in zip(r["last_tokens_s"], r["last_tokens_path"]))
    switch = "no token ran captured" if r["tokens_before_captured"] is None else \
        f"{r['tokens_before_captured']} tokens ({r['seconds_before_captured']:.1f} s) before the first captured one"
    return (f"  background load: {switch} (eager median {r['eager_token_s_median']:.2f} s); {r['blocks_placed']} "
            f"blocks placed, longest place_loaded {r['longest_place_s'] * 1e3:.0f} ms; {r['blocks_left_in_save']} "
            f"blocks left in the save; last tokens {last} ms")
