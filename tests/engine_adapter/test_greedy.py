"""Decoder.continue_greedy without an eos_id runs ahead of the host (each token's input its predecessor's argmax
on the device, ids recorded when the host learns them); it must equal one decode_step per token."""

from __future__ import annotations

import pytest
import torch

from engine_adapter.decoder import Decoder
from engine_adapter.weights import random_llama
from tests.engine_adapter.test_llama import TINY, store_for


def greedy(captured: bool, ahead: bool, ids: list[int], num_new: int) -> tuple[list[int], tuple, torch.Tensor]:
    """(tokens, layer 1's K/V, layer 1's sketch codes of full blocks) of num_new greedy tokens after a prefill."""
    model = random_llama(TINY, seed=5, vocab_size=97)
    with store_for(TINY) as store:
        decoder = Decoder(model, store)
        seq = store.create_sequence()
        logits = decoder.prefill(seq, ids, 16)
        if ahead:
            out = decoder.continue_greedy(seq, logits, num_new, "topk", 48)
        else:
            out = [int(logits.argmax())]
            while len(out) < num_new:
                out.append(int(decoder.decode_step(seq, out[-1], "topk", 48).argmax()))
        assert decoder.length(seq) == len(ids) + num_new - 1 and store.token_ids(seq) == ids + out[:-1]
        assert bool(decoder.graph_decoders.graphs) == captured  # which path ran
        assert store.stats()["tiers"]["warm"]["blocks"] > 0  # hot -> warm cooling happened under it
        store.check_integrity()
        table = store.table(seq, 1)
        return out, store.read(seq, 1), table.sketch[: table.num_tokens // 16].clone()


@pytest.mark.parametrize("captured", [False, True])
def test_greedy_without_eos_runs_ahead_and_equals_the_per_token_loop(monkeypatch: pytest.MonkeyPatch,
                                                                      captured: bool) -> None:
    """Same tokens, K/V, sketch codes and token record across block boundaries (16-token blocks) and cooling.
    captured=False: on CPU every token falls back to the eager step; captured=True: through GraphDecoder (its
    forward runs eagerly on CPU), the captured path's bookkeeping (the GPU test replays real graphs)."""
    if captured:
        monkeypatch.setattr(Decoder, "_captures", lambda self: True)
    ids = list(range(7, 47))
    (out_a, (k_a, v_a), codes_a), (out_b, (k_b, v_b), codes_b) = (greedy(captured, ahead, ids, 60)
                                                                  for ahead in (True, False))
    assert out_a == out_b
    assert torch.equal(k_a, k_b) and torch.equal(v_a, v_b) and torch.equal(codes_a, codes_b)
