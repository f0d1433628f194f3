"""SlotBatch (rows that sequences join and leave between tokens) against each sequence's DecodeStep alone in a
twin store: the same outputs (bit for bit on CPU; within fp16 rounding on CUDA, where the kernel's split plan
depends on the row count), the same stored K/V, summaries and H2O scores, across joins and leaves in the middle
of a run, with empty rows fed garbage, and one member reading cold blocks from the cpu tier. The graph key, and
so the captures GraphedSteps makes, changes only with the members that stage cpu blocks."""

from __future__ import annotations

import pytest
import torch

from kvstore.decode.batch_slots import SlotBatch
from kvstore.decode.graphs import GraphedSteps
from tests.kvstore.decode.test_batch import DEVICE, SPEC, filled, work

LENGTHS = (300, 700, 200, 350)  # all past their dense phase (k = 8 blocks); the second has cpu blocks
# (token, sequence index, "join" or "leave"), before that token
SCHEDULE = [(0, 0, "join"), (0, 1, "join"), (5, 2, "join"), (12, 0, "leave"), (14, 3, "join"), (20, 1, "leave")]
NUM_TOKENS = 24


def test_rows_equal_each_sequence_alone_across_joins_and_leaves(tmp_path):
    alone, seqs = filled(tmp_path, "a", LENGTHS)
    rows, rseqs = filled(tmp_path, "r", LENGTHS)
    assert rows.table(rseqs[1], 0).num_cold > 10 and not any(rows.table(s, 0).num_cold for s in rseqs[::2])
    singles = [alone.decode_step(s, mode="topk", budget=128) for s in seqs]
    steps = [rows.decode_step(s, mode="topk", budget=128) for s in rseqs]
    width = max(s.capacity for s in steps) + 5
    batch = SlotBatch(4, width, steps[0])
    tokens = work(len(seqs), NUM_TOKENS, seed=6)  # [T, L, S, 3, 4, 32]
    garbage = work(4, NUM_TOKENS, seed=7)  # what the empty rows are fed
    live: list[int] = []  # sequence indices in the batch
    got, now = {}, [0]

    def forward() -> None:  # one token of every layer: a model's forward around batch.attend
        t = now[0]
        x = garbage[t].clone()  # [L, R, 3, 4, 32]
        for i in live:
            x[:, batch.row_of(rseqs[i])] = tokens[t, :, i]
        got[t] = [batch.attend(layer, x[layer, :, 0], x[layer, :, 1, :2], x[layer, :, 2, :2])
                  for layer in range(SPEC.num_layers)]

    graphed = GraphedSteps(batch, forward)
    keys = []
    for t in range(NUM_TOKENS):
        for _, i, what in [e for e in SCHEDULE if e[0] == t]:
            if what == "join":
                batch.join(steps[i] if steps[i] is not None else rows.decode_step(rseqs[i], mode="topk", budget=128))
                live.append(i)
            else:
                batch.leave(rseqs[i])
                steps[i] = None
                live.remove(i)
        now[0] = t
        graphed()
        keys.append(batch.graph_key())
        for i in live:
            single = singles[i]
            single.begin_token()
            for layer in range(SPEC.num_layers):
                x = tokens[t, layer, i]
                want = single.attend(layer, x[0], x[1, :2], x[2, :2])
                out = got[t][layer][batch.row_of(rseqs[i])]
                if DEVICE == "cpu":
                    assert torch.equal(out, want), (t, layer, i)
                else:
                    torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
            single.end_token()
    batch.verify()
    # the cpu blocks' reader staged its own; the others never did: two keys, one capture each, for six changes
    stager = ((1, rseqs[1], batch.k),)  # row 1, its staging rows the second lane's
    assert len(set(keys)) == 2 and keys[0][0] == stager and keys[-1][0] == () and graphed.captures == 2
    assert rows.stats()["attend"]["cold_slices_staged"] > 0
    for a, b in zip(seqs, rseqs):  # the empty rows wrote nothing into any sequence
        for layer in range(SPEC.num_layers):
            ta, tb = alone.table(a, layer), rows.table(b, layer)
            assert ta.num_tokens == tb.num_tokens
            assert all(torch.equal(x, y) for x, y in zip(alone.read(a, layer), rows.read(b, layer)))
            n = ta.num_blocks
            assert torch.equal(ta.summaries[:n], tb.summaries[:n])
            torch.testing.assert_close(ta.h2o_scores[:, :n], tb.h2o_scores[:, :n], atol=0 if DEVICE == "cpu" else 2e-2,
                                       rtol=0 if DEVICE == "cpu" else 1e-2)
    rows.check_integrity()
    alone.close(), rows.close()


def test_a_row_batch_refuses_what_it_cannot_run(tmp_path):
    """A dense-phase sequence, tables wider than the batch, a full batch, a sequence twice, a non-member's
    leave, another mode: clear errors, and the batch as it was."""
    store, seqs = filled(tmp_path, "f", (300, 100, 700, 400))
    steps = [store.decode_step(s, mode="topk", budget=128) for s in seqs]
    with pytest.raises(ValueError, match="mode 'topk'"):
        SlotBatch(2, 2048, store.decode_step(seqs[0], mode="dense"))
    batch = SlotBatch(2, max(s.capacity for s in steps), steps[0])
    with pytest.raises(ValueError, match="dense phase"):
        batch.join(steps[1])  # 101 tokens: its dense phase (k = 8 blocks)
    narrow = SlotBatch(2, steps[0].capacity - 1, steps[0])
    with pytest.raises(ValueError, match="wider than"):
        narrow.join(steps[0])
    batch.join(steps[0])
    with pytest.raises(ValueError, match="a member already"):
        batch.join(store.decode_step(seqs[0], mode="topk", budget=128))
    with pytest.raises(ValueError, match="k 16"):
        batch.join(store.decode_step(seqs[3], mode="topk", budget=256))
    batch.join(steps[2])
    with pytest.raises(ValueError, match="a full batch"):
        batch.join(steps[3])
    with pytest.raises(KeyError):
        batch.leave(seqs[3])
    assert batch.seqs == (seqs[0], seqs[2]) and len(batch) == 2
    store.close()
