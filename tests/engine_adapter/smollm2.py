"""The real model, loaded once per test process, for the quality tests (skipped when it is not installed)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

PROSE = Path(__file__).resolve().parents[1] / "data" / "prose.txt"  # original text, ~3.3K SmolLM2 tokens


@functools.cache
def _load():
    try:
        from engine_adapter.weights import find_gguf, llama_from_hf, load_hf

        find_gguf("smollm2-135m")
    except (ImportError, FileNotFoundError) as exc:  # transformers/gguf or the model package missing
        return None, str(exc)
    hf_model, tokenizer = load_hf("smollm2-135m")
    return (hf_model, tokenizer, llama_from_hf(hf_model)), ""


def smollm2():
    """(HF model, tokenizer, kvtier Llama), or skip with the reason."""
    loaded, reason = _load()
    if loaded is None:
        pytest.skip(f"SmolLM2-135M not available: {reason}")
    return loaded


@functools.cache
def prose_ids() -> tuple[int, ...]:
    _, tokenizer, _ = smollm2()
    return tuple(tokenizer(PROSE.read_text(encoding="utf-8"))["input_ids"])


@functools.cache
def hf_greedy(num_prompt: int, max_new_tokens: int) -> tuple[tuple[int, ...], torch.Tensor]:
    """HF's own greedy continuation (its DynamicCache) of the first num_prompt prose tokens,
    and the fp32 logits [vocab] it chose the first token from."""
    hf_model, _, _ = smollm2()
    ids = torch.tensor([prose_ids()[:num_prompt]])
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                                output_logits=True, return_dict_in_generate=True)
    return tuple(out.sequences[0, num_prompt:].tolist()), out.logits[0][0].float()
