"""Decoder.decode_batch: sequences of different lengths decoded together, joining and leaving between tokens,
give each sequence the greedy tokens it gets decoded alone (the captured batch step's bookkeeping: its
forward runs eagerly on CPU; the GPU tests replay real graphs)."""

from __future__ import annotations

import pytest
import torch

from engine_adapter.decoder import Decoder
from engine_adapter.row_decode import row_bucket, width_bucket
from engine_adapter.weights import random_llama
from tests.engine_adapter.test_llama import TINY, store_for

PROMPTS = [list(range(7, 47)), list(range(3, 96)) + list(range(1, 30)), list(range(50, 80)) * 3]
NEW = 40
# (token index, sequences decoded at it): the third joins at 8, the first leaves after 25
MEMBERS = [(t, [s for s in range(3) if (s != 2 or t >= 8) and (s != 0 or t < 25)]) for t in range(NEW)]


def alone(mode: str) -> list[list[int]]:
    """Each prompt's greedy tokens decoded by itself (decode_step per token)."""
    model = random_llama(TINY, seed=5, vocab_size=97)
    out = []
    with store_for(TINY) as store:
        decoder = Decoder(model, store)
        for prompt in PROMPTS:
            seq = store.create_sequence()
            tokens = [int(decoder.prefill(seq, prompt, 16).argmax())]
            while len(tokens) < NEW:
                tokens.append(int(decoder.decode_step(seq, tokens[-1], mode, 48).argmax()))
            out.append(tokens)
    return out


@pytest.mark.parametrize("mode", ["topk", "dense"])  # sketch: tests/kvstore/decode/test_batch.py
def test_a_batch_with_joins_and_leaves_decodes_what_each_sequence_does_alone(monkeypatch, mode):
    monkeypatch.setattr(Decoder, "_captures", lambda self: True)
    want = alone(mode)
    model = random_llama(TINY, seed=5, vocab_size=97)
    with store_for(TINY) as store:
        decoder = Decoder(model, store)
        seqs = [store.create_sequence() for _ in PROMPTS]
        got = [[int(decoder.prefill(s, p, 16).argmax())] for s, p in zip(seqs, PROMPTS)]
        batches = set()
        for _, members in MEMBERS:
            live = [m for m in members if len(got[m]) < NEW]
            logits = decoder.decode_batch([seqs[m] for m in live], [got[m][-1] for m in live], mode, 48)
            assert logits.shape == (len(live), 97)
            for row, m in enumerate(live):
                got[m].append(int(logits[row].argmax()))
            batches.add(tuple(live))
            batches_held = [key for key in decoder.graph_decoders.graphs if len(key[0]) > 1]
            assert len(batches_held) <= 1  # a new batch replaces the old one
        assert {(0, 1), (0, 1, 2), (1, 2)} <= batches
        for m, seq in enumerate(seqs):  # every token but the last generated one was appended
            assert store.token_ids(seq) == PROMPTS[m] + got[m][:-1]
        store.check_integrity()
    assert [len(g) for g in got] == [26, NEW, NEW - 8 + 1]
    assert got == [w[: len(g)] for g, w in zip(got, want)]


def test_decode_batch_refuses_bad_requests_before_anything_changes():
    model = random_llama(TINY, seed=5, vocab_size=97)
    with store_for(TINY) as store:
        decoder = Decoder(model, store)
        a, b = store.create_sequence(), store.create_sequence()
        decoder.prefill(a, [1, 2, 3], 16), decoder.prefill(b, [4, 5], 16)
        for seqs, ids in (([a, a], [1, 2]), ([a, b], [1]), ([a, b], [1, 97]), ([a, b], [1, True]), ([], [])):
            with pytest.raises(ValueError):
                decoder.decode_batch(seqs, ids)
        with pytest.raises(KeyError):
            decoder.decode_batch([a, 999], [1, 2])
        assert (decoder.length(a), decoder.length(b)) == (3, 2)
        assert store.token_ids(a) == [1, 2, 3] and store.token_ids(b) == [4, 5]


ROW_STORE = dict(cpu_checksums="cpu", cpu_dtype="int8", staging_tokens=4 * 64)  # a lane of 4 blocks per row


def test_rows_replay_their_graph_while_sequences_join_and_leave(monkeypatch):
    """Sequences past their dense phase (k = 4 blocks of 16 at budget 48) decoded in rows (the scheduler's
    decode_batch(rows=True)): three start (4 rows), a fourth whose prompt left blocks in the cpu tier (staged
    inside the step, verified on the device) joins, two leave, then the fourth leaves; the same RowDecoder and
    graph key serve every token, so only the first token captures, and each sequence's greedy tokens are its
    tokens alone."""
    monkeypatch.setattr(Decoder, "_captures", lambda self: True)
    prompts = [list(range(7, 97)), PROMPTS[1], PROMPTS[2], [(7 * i) % 97 for i in range(480)]]
    live_at = [[m for m in range(4) if (m != 3 or 5 <= t < 30) and (m != 0 or t < 12) and (m != 1 or t < 20)]
               for t in range(1, NEW)]  # the sequences of each decoded token: 3 joins, 0 and 1 leave, 3 leaves
    lengths = [1 + sum(m in live for live in live_at) for m in range(4)]  # tokens each one gets
    model = random_llama(TINY, seed=5, vocab_size=97)
    want = []
    with store_for(TINY, **ROW_STORE) as store:
        decoder = Decoder(model, store)
        for prompt, n in zip(prompts, lengths):
            seq = store.create_sequence()
            tokens = [int(decoder.prefill(seq, prompt, 16).argmax())]
            while len(tokens) < n:
                tokens.append(int(decoder.decode_step(seq, tokens[-1], "topk", 48).argmax()))
            want.append(tokens)
    with store_for(TINY, **ROW_STORE) as store:
        decoder = Decoder(model, store)
        seqs = [store.create_sequence() for _ in prompts]
        got = [[int(decoder.prefill(s, p, 16).argmax())] for s, p in zip(seqs, prompts)]
        assert store.table(seqs[3], 0).num_cold > 5 and not any(store.table(s, 0).num_cold for s in seqs[:3])
        decoders, keys, captures = set(), set(), []
        for live in live_at:
            logits = decoder.decode_batch([seqs[m] for m in live], [got[m][-1] for m in live], "topk", 48, rows=True)
            for row, m in enumerate(live):
                got[m].append(int(logits[row].argmax()))
            graph = decoder.graph_decoders.rows.active[48]
            assert graph.seqs == tuple(seqs[m] for m in live)
            decoders.add(id(graph))
            keys.add(graph.step.graph_key())
            captures.append(decoder.graph_decoders.captures)
        assert len(decoders) == 1 and len(keys) == 1 and graph.step.num_rows == 4
        assert captures[0] == 1 and captures[-1] == 1  # the first token's capture, none for the 4 changes
        assert decoder.paths == {"captured": sum(map(len, live_at)), "eager": 0}
        assert store.stats()["attend"]["cold_slices_staged"] > 0
        store.check_integrity()
    assert got == want


def test_row_and_width_buckets():
    """Rows: 1, 2, 4, 8, then multiples of 8; widths: at most a quarter octave (25%) past the widest table."""
    assert [row_bucket(n) for n in (1, 2, 3, 5, 8, 9, 17, 41, 48)] == [1, 2, 4, 8, 8, 16, 24, 48, 48]
    assert [width_bucket(n) for n in (5, 768, 769, 1032)] == [5, 768, 896, 1280]
    assert all(n <= width_bucket(n) <= 1.25 * n for n in range(1, 5000))
