"""Quality probes over a Decoder: passkey retrieval (Mohtashami & Jaggi, 2023) and perplexity.

Prompts are built from token-id pieces so their length is exact: an intro, filler
repeated around a needle planted at a relative depth, and a question whose answer
the model completes.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.nn.functional as F

from engine_adapter.decoder import Decoder

Tokenizer = Any  # a transformers tokenizer: __call__(text)["input_ids"] and decode(ids)

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it at the end.")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\n\nWhat is the pass key? The pass key is "  # the trailing space makes the next token a digit


def passkey_prompt(tokenizer: Tokenizer, total_tokens: int, depth: float, passkey: str,
                   filler: str = FILLER) -> list[int]:
    """Token ids of a passkey prompt of exactly total_tokens tokens, the needle at relative depth in [0, 1]."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    if not re.fullmatch(r"\d{5}", passkey):
        raise ValueError(f"passkey must be 5 digits, got {passkey!r}")

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    intro, needle, question = encode(INTRO), encode(NEEDLE.format(key=passkey)), encode(QUESTION)
    piece = encode(filler)
    room = total_tokens - len(intro) - len(needle) - len(question)
    if room < 0 or not piece:
        raise ValueError(f"total_tokens must be at least {total_tokens - room} for this needle, got {total_tokens}")
    haystack = (piece * (room // len(piece) + 1))[:room]
    cut = int(round(depth * room))
    return intro + haystack[:cut] + needle + haystack[cut:] + question


def read_passkey(text: str) -> str | None:
    """The first number in a continuation (spaces between digits ignored), or None."""
    found = re.search(r"\d+", text.replace(" ", ""))
    return found.group(0) if found else None


def passkey_by_mode(decoder: Decoder, tokenizer: Tokenizer, prompt_ids: list[int],
                    modes: dict[str, int | tuple[str, int]], max_new_tokens: int = 6,
                    chunk_tokens: int = 512) -> dict[str, str | None]:
    """Prefill once, then answer under each mode -> budget (or label -> (mode, budget), to run one mode at
    several budgets); returns mode (label) -> passkey read (or None)."""
    base = decoder.store.create_sequence()
    try:
        logits = decoder.prefill(base, prompt_ids, chunk_tokens)
        answers = {}
        for label, run in modes.items():
            mode, budget = run if isinstance(run, tuple) else (label, run)
            seq = decoder.fork(base)
            try:
                ids = decoder.continue_greedy(seq, logits, max_new_tokens, mode, budget)
            finally:
                decoder.free(seq)
            answers[label] = read_passkey(tokenizer.decode(ids))
        return answers
    finally:
        decoder.free(base)


def perplexity(decoder: Decoder, token_ids: list[int], chunk_tokens: int = 256, seq: int | None = None) -> float:
    """exp(mean next-token NLL) of one window, prefilled chunk by chunk through the store.

    seq: an empty sequence to use, left holding the window for the caller to inspect and free;
    by default a temporary one."""
    if len(token_ids) < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {len(token_ids)}")
    targets = torch.as_tensor(token_ids[1:], dtype=torch.long)
    owned, total, done = seq is None, 0.0, 0
    seq = decoder.store.create_sequence() if owned else seq
    try:
        for logits in decoder.prefill_logits(seq, token_ids, chunk_tokens, all_logits=True):
            logits = logits[: len(targets) - done]  # the last position has no target
            total += float(F.cross_entropy(logits, targets[done : done + logits.shape[0]], reduction="sum"))
            done += logits.shape[0]
    finally:
        if owned:
            decoder.free(seq)
    return math.exp(total / len(targets))


def read_back_nll(decoder: Decoder, seq: int, token_ids: list[int], chunk_tokens: int = 128) -> torch.Tensor:
    """Next-token NLL [len(token_ids) - 1] (fp32) of token_ids appended to seq, one prefill call per chunk.

    Each chunk attends to every earlier token as the store reads it back (warm blocks in their format), the
    way decode reads them; a single prefill call would keep the whole window's K/V in fp16 on the device and
    never see the warm format. seq keeps the window afterwards."""
    if len(token_ids) < 2 or chunk_tokens <= 0:
        raise ValueError(f"need >= 2 tokens and chunk_tokens > 0, got {len(token_ids)} and {chunk_tokens}")
    out = []
    for lo in range(0, len(token_ids), chunk_tokens):
        targets = torch.as_tensor(token_ids[lo + 1: lo + 1 + chunk_tokens], dtype=torch.long)
        with torch.no_grad():
            logits = decoder.forward_chunk(seq, token_ids[lo: lo + chunk_tokens], all_logits=True)  # [t, vocab]
        if len(targets):  # the last token has no target, but enters the store
            out.append(F.cross_entropy(logits[: len(targets)].float(), targets.to(logits.device), reduction="none"))
    return torch.cat(out).cpu()
