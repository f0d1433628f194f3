"""Two gloo processes decode one sequence sharded over them (ContextParallelDecoder) and give the greedy tokens
and logits of one process holding the whole sequence (Decoder): dense against its plain decode; topk and sketch
against its decode over the ranks' selection (kvstore.parallel.ShardedSelection as the mode)."""

from __future__ import annotations

import pytest
import torch

from engine_adapter.context_parallel import ContextParallelDecoder
from engine_adapter.decoder import Decoder
from engine_adapter.weights import random_llama
from kvstore import Config, KVStore
from kvstore.parallel.group import RankGroup, spawn
from kvstore.parallel.reference import ShardedSelection
from kvstore.parallel.shards import ShardPlan
from tests.engine_adapter.test_llama import TINY

PROMPT = [(7 * i + 3) % 97 for i in range(120)]
NEW, BUDGET, MODES = 10, 64, ("dense", "topk", "sketch")


def make_store() -> KVStore:  # every block fp16 (hot): see tests/kvstore/parallel/test_sharded_sequence.py
    return KVStore(Config(model=TINY, block_tokens=16, sink_tokens=16, hot_tokens=1024, recent_tokens=16,
                          gpu_bytes=8 << 20, cpu_bytes=8 << 20, device="cpu"))


def greedy(step, first_logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    logits = [first_logits]
    while len(logits) < NEW:
        logits.append(step(int(logits[-1].argmax())))
    stacked = torch.stack(logits)  # [NEW, vocab]
    return stacked.argmax(-1).tolist(), stacked


def run_rank(group: RankGroup) -> dict:
    model = random_llama(TINY, seed=5, vocab_size=97)
    out = {}
    for mode in MODES:
        with make_store() as store:
            decoder = ContextParallelDecoder(model, store, group)
            out[mode] = greedy(lambda t: decoder.decode_step(t, mode, BUDGET), decoder.prefill(PROMPT, 64))
            store.check_integrity()
            out[mode + " held"] = store.table(decoder.sequence.seq, 0).num_tokens
    return out


def one_process(mode: str) -> tuple[list[int], torch.Tensor]:
    model = random_llama(TINY, seed=5, vocab_size=97)
    with make_store() as store:
        decoder = Decoder(model, store)
        seq = store.create_sequence()
        plan = ShardPlan.split(len(PROMPT), 2, 16)
        policy = mode if mode == "dense" else ShardedSelection(plan, mode, store.policies["topk"], store.policies[mode])
        return greedy(lambda t: decoder.decode_step(seq, t, policy, BUDGET), decoder.prefill(seq, PROMPT, 64))


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return spawn(run_rank, 2, "gloo")


@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_decode_the_greedy_tokens_of_one_process(ranks: list[dict], mode: str) -> None:
    want_tokens, want_logits = one_process(mode)
    for r in ranks:
        tokens, logits = r[mode]
        assert tokens == want_tokens
        torch.testing.assert_close(logits, want_logits, atol=1e-3, rtol=1e-3)
    assert [r[mode + " held"] for r in ranks] == [64, len(PROMPT) + NEW - 1 - 64]  # rank 1 owns the appends
    if mode != "dense":  # a budgeted decode reads fewer blocks, so the tokens differ from the dense ones
        assert ranks[0][mode][0] != ranks[0]["dense"][0] or not torch.equal(ranks[0][mode][1], ranks[0]["dense"][1])


def test_misuse_is_refused_before_anything_is_stored() -> None:
    model = random_llama(TINY, seed=5, vocab_size=97)
    with make_store() as store:
        with pytest.raises(ValueError, match="fewer than the 2 ranks"):  # refused before any collective
            ContextParallelDecoder(model, store, RankGroup(0, 2)).prefill(list(range(10)))
        assert not store.sequences
        decoder = ContextParallelDecoder(model, store, RankGroup(0, 1))
        with pytest.raises(ValueError, match="before decode_step"):
            decoder.decode_step(3)
        decoder.prefill([1, 2, 3])
        with pytest.raises(ValueError, match="one prefill"):
            decoder.prefill([4])
        with pytest.raises(ValueError, match="mode must be"):
            decoder.decode_step(3, "h2o")
