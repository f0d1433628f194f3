"""Scheduler: continuous batching in a store too small for every request at once. Requests queue until they
fit, decode together (the captured batch step's bookkeeping; its forward runs eagerly on CPU), and each one's
greedy tokens equal the same prompt generated alone, preempted and resumed ones included; requests that can
never fit are refused and change nothing."""

from __future__ import annotations

import pytest
import torch

from engine_adapter.decoder import Decoder
from engine_adapter.serving import Request, Scheduler
from engine_adapter.weights import random_llama
from tests.engine_adapter.test_llama import TINY, store_for

VOCAB = 97
# every block's format set by its position alone (a short fp16 window, int8 beyond, also in cpu), so a request
# reads the same values whichever tier room puts its blocks in
WINDOWS = dict(hot_tokens=32, cpu_dtype="int8", cpu_checksums="cpu", staging_tokens=64)
# about two requests at a time, the hot pool sized for both (Scheduler warns when more run than it holds)
SMALL = dict(gpu_bytes=96 << 10, cpu_bytes=64 << 10, hot_sequences=2, **WINDOWS)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone(requests: list[Request], mode: str) -> dict[str, list[int]]:
    model = random_llama(TINY, seed=5, vocab_size=VOCAB)
    with store_for(TINY, **WINDOWS) as store:
        decoder = Decoder(model, store)
        return {r.request_id: decoder.generate(store.create_sequence(), r.prompt, r.max_new_tokens, mode, 48)
                for r in requests}


class Steps:
    """A clock that advances one unit per scheduler step: arrivals are given in steps."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run(scheduler: Scheduler, clock: Steps, limit: int = 500) -> None:
    for _ in range(limit):
        if not scheduler.pending:
            return
        scheduler.step()
        clock.t += 1
        scheduler.store.check_integrity()
    raise AssertionError("the trace did not finish")


@pytest.mark.parametrize("mode, running", [("topk", 2), ("dense", 2), ("h2o", 4)])
def test_a_trace_larger_than_the_store_finishes_and_each_request_decodes_as_alone(monkeypatch, mode, running):
    """h2o keeps 48 tokens of a request once it decodes, and the blocks it drops make room for all four at once:
    the hot pool then holds four sequences' sinks and windows (Config.hot_sequences; with fewer, room is made by
    cooling a sink block to int8, and that request's tokens differ from alone)."""
    monkeypatch.setattr(Decoder, "_captures", lambda self: True)
    requests = [Request(f"r{i}", max_new_tokens=12 + 3 * i, prompt=prompt(250 + 40 * i, i), arrival_s=2 * i)
                for i in range(4)]
    want = alone(requests, mode)
    model, clock = random_llama(TINY, seed=5, vocab_size=VOCAB), Steps()
    with store_for(TINY, **{**SMALL, "hot_sequences": running}) as store:
        scheduler = Scheduler(Decoder(model, store), mode, 48, clock=clock)
        for r in requests:
            scheduler.submit(r)
        most = 0
        for _ in range(500):
            if not scheduler.pending:
                break
            scheduler.step()
            most = max(most, len(scheduler.running))
            clock.t += 1
            store.check_integrity()
        assert most == running  # never more than fit, and as many at once as fit
        assert store.stats()["sequences"]["count"] == 0
    assert {r.request_id: r.output for r in scheduler.finished} == want
    assert any(r.admitted_s > r.arrival_s for r in requests) == (mode != "h2o")  # some waited for room


def test_a_higher_priority_request_preempts_and_the_preempted_one_resumes_unchanged(monkeypatch):
    monkeypatch.setattr(Decoder, "_captures", lambda self: True)
    low = [Request(f"low{i}", max_new_tokens=30, prompt=prompt(300, 10 + i)) for i in range(2)]
    high = Request("high", max_new_tokens=10, prompt=prompt(300, 20), priority=1, arrival_s=5)
    want = alone(low + [high], "topk")
    model, clock = random_llama(TINY, seed=5, vocab_size=VOCAB), Steps()
    with store_for(TINY, **SMALL) as store:
        scheduler = Scheduler(Decoder(model, store), "topk", 48, clock=clock)
        for r in low + [high]:
            scheduler.submit(r)
        run(scheduler, clock)
        assert store.saved_contexts() == []  # resumed contexts' saves are deleted
    assert scheduler.preemptions == 1 and sum(r.preemptions for r in low) == 1
    assert [r.request_id for r in scheduler.finished][0] == "high"  # it ran ahead of the one it preempted
    assert {r.request_id: r.output for r in scheduler.finished} == want


def test_finished_requests_return_their_blocks_between_tokens_and_at_once_when_a_request_waits(monkeypatch):
    """Freed in small batches before each token, a finished request's blocks still make room for the next one
    exactly when an immediate free would: the same admissions, the same outputs."""
    monkeypatch.setattr(Decoder, "_captures", lambda self: True)
    requests = [Request(f"r{i}", max_new_tokens=6 + 5 * i, prompt=prompt(250 + 40 * i, 30 + i), arrival_s=i)
                for i in range(4)]
    runs, free = {}, Decoder.free
    for background in (True, False):
        if not background:  # the reference: every finished request freed at once
            monkeypatch.setattr(Decoder, "free", lambda self, seq, background=False: free(self, seq))
        trace = [Request(r.request_id, r.max_new_tokens, list(r.prompt), arrival_s=r.arrival_s) for r in requests]
        model, clock, pending = random_llama(TINY, seed=5, vocab_size=VOCAB), Steps(), []
        with store_for(TINY, **SMALL) as store:
            release = store.release_freed
            monkeypatch.setattr(store, "release_freed", lambda max_blocks=3: release(max_blocks))
            scheduler = Scheduler(Decoder(model, store), "topk", 48, clock=clock)
            for r in trace:
                scheduler.submit(r)
            for _ in range(500):
                if not scheduler.pending:
                    break
                scheduler.step()
                pending.append(store.freeing_blocks())
                clock.t += 1
                store.check_integrity()
            assert store.stats()["sequences"]["count"] == 0
        runs[background] = ({r.request_id: (r.admitted_s, r.output) for r in trace}, pending)
    assert runs[True][0] == runs[False][0]
    assert any(runs[True][1]) and not any(runs[False][1])  # blocks were still being returned between tokens


def test_running_more_requests_than_the_hot_pool_holds_warns_once(monkeypatch):
    monkeypatch.setattr(Decoder, "_captures", lambda self: True)
    model, clock = random_llama(TINY, seed=5, vocab_size=VOCAB), Steps()
    requests = [Request(f"r{i}", max_new_tokens=4, prompt=prompt(250, 30 + i)) for i in range(3)]
    with store_for(TINY, **{**SMALL, "cpu_bytes": 1 << 20}) as store:  # room for three, hot pool for two
        scheduler = Scheduler(Decoder(model, store), "topk", 48, clock=clock)
        for r in requests:
            scheduler.submit(r)
        with pytest.warns(RuntimeWarning, match="3 requests run at once, .*hot_sequences=2") as caught:
            run(scheduler, clock)
    assert len([w for w in caught if "hot_sequences" in str(w.message)]) == 1


def test_requests_that_cannot_be_served_are_refused_and_change_nothing():
    model = random_llama(TINY, seed=5, vocab_size=VOCAB)
    with store_for(TINY, **SMALL) as store:
        scheduler = Scheduler(Decoder(model, store), "topk", 48)
        scheduler.submit(Request("ok", max_new_tokens=4, prompt=prompt(20, 1)))
        bad = [Request("huge", max_new_tokens=4, prompt=prompt(2000, 2)),  # more than the whole store holds
               Request("none", max_new_tokens=0, prompt=prompt(20, 3)),
               Request("both", max_new_tokens=4, prompt=prompt(20, 3), context_tokens=20),
               Request("fill", max_new_tokens=4, context_tokens=20),  # no fill given
               Request("ok", max_new_tokens=4, prompt=prompt(20, 4))]  # a taken id
        for request in bad:
            with pytest.raises(ValueError):
                scheduler.submit(request)
        assert [r.request_id for r in scheduler.waiting] == ["ok"] and store.free_blocks() == scheduler.capacity
