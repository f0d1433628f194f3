"""A DecodeStep's host work at block boundaries: what the next token pushes out of its window cools right after
this token's launch (readiness.cool_ahead), and a batch opens its sequences' new tail entries in one launch
(step_parts.open_tail_entries). Runs on CPU (the kernel through Triton's interpreter)."""

from __future__ import annotations

import torch

from kvstore.attention.append import open_tails_ref
from kvstore.decode.step_parts import open_tail_entries
from tests.kvstore.decode.test_step import SPEC, filled, make_store, tokens


def test_what_the_next_token_cools_moves_right_after_this_token(tmp_path):
    """end_token cools what the next token pushes out of its window (queued behind the token on the GPU, its host
    work overlapping it); the next begin_token then moves nothing, unless a block moved back meanwhile."""
    store = make_store(tmp_path, "e")
    seq = filled(store, 200, seed=4)
    step = store.decode_step(seq, mode="topk", budget=128)
    tier_of, tables = store.tiers.blocks.tier_of, [store.table(seq, layer) for layer in range(SPEC.num_layers)]
    leaving = [t.block_ids[4] for t in tables]  # tokens [64, 80): in the 128-token hot window until 207 tokens
    work = tokens(8, seed=5)

    def decode(t: int) -> None:
        step.begin_token()
        for layer in range(SPEC.num_layers):
            step.attend(layer, *work[t * SPEC.num_layers + layer])

    for t in range(6):  # 200 -> 206 tokens
        decode(t)
        step.end_token()
    assert {tier_of[b] for b in leaving} == {0}
    decode(6)  # the token that makes 207 runs with them hot ...
    assert {tier_of[b] for b in leaving} == {0}
    step.end_token()  # ... and after it they cool, before the token that needs them warm
    assert {tier_of[b] for b in leaving} == {1}
    moves = [t.moves for t in tables]
    assert step.cooling() == []
    # moved back up meanwhile, as a tail would be (fp16): the next token weighs its blocks again
    store.tiers.move(leaving[:1], 1, 0, keep_format=False)
    assert len(step.cooling()) == SPEC.num_layers
    decode(7)
    assert {tier_of[b] for b in leaving} == {1} and [t.moves for t in tables] > moves
    step.end_token()
    store.check_integrity()
    store.close()


def test_a_batch_opens_its_sequences_new_tails_in_one_launch(tmp_path):
    """open_tail_entries over two sequences of different lengths (each table's new tail at its own entry): the
    kernel's one launch, run by the interpreter off CUDA, opens what the reference opens, and nothing else."""
    store = make_store(tmp_path, "f")
    steps = [store.decode_step(filled(store, n, seed=n), mode="topk", budget=128) for n in (96, 160)]
    for step in steps:
        for t in step.tables:
            t.h2o_scores.uniform_(1, 2)
    want = [[(t.summaries.clone(), t.h2o_scores.clone()) for t in s.tables] for s in steps]
    for s, tables in zip(steps, want):
        open_tails_ref([w[0] for w in tables], [w[1] for w in tables], [t.num_blocks - 1 for t in s.tables])
    open_tail_entries(steps, kernel=True)
    for s, tables in zip(steps, want):
        for t, (summaries, h2o) in zip(s.tables, tables):
            for got, expected in ((t.summaries, summaries), (t.h2o_scores, h2o)):  # capacity past the table: as left
                torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    assert not steps[1].tables[0].h2o_scores[:, 9].any() and steps[1].tables[0].h2o_scores[:, 8].all()
    store.close()
