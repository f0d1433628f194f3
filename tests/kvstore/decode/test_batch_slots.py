"""SlotBatch (rows that sequences join and leave between tokens) against each sequence's DecodeStep alone in a
twin store: the same outputs (bit for bit on CPU; within fp16 rounding on CUDA, where the kernel's split plan
depends on the row count), the same stored K/V, summaries and H2O scores, across joins and leaves in the middle
of a run, with empty rows fed garbage, and two members reading cold blocks from the cpu tier. The graph key, and
so the captures GraphedSteps makes, does not change when members join or leave, cpu blocks or not; a damaged
cpu slice is reported for its row's sequence alone."""

from __future__ import annotations

import pytest
import torch

from kvstore.blocks.tierset import CPU_TIER
from kvstore.decode.batch_slots import SlotBatch
from kvstore.decode.graphs import GraphedSteps
from tests.kvstore.decode.test_batch import DEVICE, SPEC, filled, work
from tiers.base import IntegrityError

LENGTHS = (300, 700, 200, 500)  # all past their dense phase (k = 8 blocks); the second and fourth have cpu blocks
# (token, sequence index, "join" or "leave"), before that token: the cpu blocks' readers join and leave mid-run
SCHEDULE = [(0, 0, "join"), (0, 2, "join"), (3, 1, "join"), (6, 0, "leave"), (9, 3, "join"), (17, 1, "leave")]
NUM_TOKENS = 24


def test_rows_equal_each_sequence_alone_across_joins_and_leaves(tmp_path):
    alone, seqs = filled(tmp_path, "a", LENGTHS)
    rows, rseqs = filled(tmp_path, "r", LENGTHS)
    assert all(rows.table(s, 0).num_cold > 5 for s in rseqs[1::2]) and not any(rows.table(s, 0).num_cold
                                                                              for s in rseqs[::2])
    singles = [alone.decode_step(s, mode="topk", budget=128) for s in seqs]
    steps = [rows.decode_step(s, mode="topk", budget=128) for s in rseqs]
    width = max(s.capacity for s in steps) + 5
    batch = SlotBatch(4, width, steps[0])
    tokens = work(len(seqs), NUM_TOKENS, seed=6)  # [T, L, S, 3, 4, 32]
    garbage = work(4, NUM_TOKENS, seed=7)  # what the empty rows are fed
    live: list[int] = []  # sequence indices in the batch
    x = garbage[0].clone()  # [L, R, 3, 4, 32]: the token's input, at one address a captured graph reads

    def forward() -> torch.Tensor:  # one token of every layer: a model's forward around batch.attend
        return torch.stack([batch.attend(layer, x[layer, :, 0], x[layer, :, 1, :2], x[layer, :, 2, :2])
                            for layer in range(SPEC.num_layers)])  # [L, R, 4, 32]

    graphed = GraphedSteps(batch, forward)
    keys, staging = [], []
    for t in range(NUM_TOKENS):
        for _, i, what in [e for e in SCHEDULE if e[0] == t]:
            if what == "join":
                batch.join(steps[i] if steps[i] is not None else rows.decode_step(rseqs[i], mode="topk", budget=128))
                live.append(i)
            else:
                batch.leave(rseqs[i])
                steps[i] = None
                live.remove(i)
        x.copy_(garbage[t])
        for i in live:
            x[:, batch.row_of(rseqs[i])] = tokens[t, :, i]
        got = graphed().clone()
        keys.append(batch.graph_key())
        staging.append(batch.staging_rows.tolist())
        for i in live:
            single = singles[i]
            single.begin_token()
            for layer in range(SPEC.num_layers):
                y = tokens[t, layer, i]
                want = single.attend(layer, y[0], y[1, :2], y[2, :2])
                out = got[layer, batch.row_of(rseqs[i])]
                if DEVICE == "cpu":
                    assert torch.equal(out, want), (t, layer, i)
                else:
                    torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
            single.end_token()
    batch.verify()
    # one key and one capture for six changes, two of them members reading cpu blocks joining and one leaving
    assert len(set(keys)) == 1 and graphed.captures == 1
    f, k = batch.staging_pool.slots.num_slots, batch.k  # each row's lane: by join order, a freed one reused
    assert staging[3] == staging[10] == [f, f + k, f + 2 * k, -1] and staging[6] == [-1, f + k, f + 2 * k, -1]
    assert staging[-1] == [f, f + k, -1, -1]
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


def test_a_damaged_cpu_slice_is_reported_for_its_row_alone(tmp_path):
    """One bit of every kv head's K flipped in each cpu block of one member (its pinned slab rows): verify raises
    IntegrityError naming that sequence and row, and no other; the other rows, one of them reading intact cpu
    blocks, attend what their sequences attend alone (bit for bit on CPU), before and after it leaves."""
    lengths = (300, 700, 500)  # the second and third have cpu blocks; the second's are damaged
    alone, seqs = filled(tmp_path, "a", lengths)
    rows, rseqs = filled(tmp_path, "r", lengths)
    cpu = rows.tiers.cpu
    for layer in range(SPEC.num_layers):
        table = rows.table(rseqs[1], layer)
        n = table.num_blocks
        for slot in table.slot_map[:n][table.tier_map[:n] == CPU_TIER].tolist():
            slab, row = divmod(slot, cpu.slab_blocks)
            cpu.slabs[slab].data[row, 0, :, 1, 2] ^= 4  # int8 [2, H, B, D]: K, every head, token 1, channel 2
    singles = [alone.decode_step(s, mode="topk", budget=128) for s in seqs]
    steps = [rows.decode_step(s, mode="topk", budget=128) for s in rseqs]
    batch = SlotBatch(4, max(s.capacity for s in steps), steps[0])
    for step in steps:
        batch.join(step)
    tokens = work(len(seqs), 5, seed=8)  # [T, L, S, 3, 4, 32]
    for t in range(5):
        if t == 3:
            with pytest.raises(IntegrityError, match=rf"sequence {rseqs[1]} \(row 1\): cpu tier: \d+ block slices") \
                    as raised:
                batch.verify()
            assert f"sequence {rseqs[2]}" not in str(raised.value) and f"sequence {rseqs[0]}" not in str(raised.value)
            batch.verify()  # reported once; the others' slices were intact
            batch.leave(rseqs[1])
        live = [0, 2] if t >= 3 else [0, 1, 2]
        x = torch.zeros((SPEC.num_layers, 4, 3, 4, 32), dtype=torch.float16, device=DEVICE)
        for i in live:
            x[:, batch.row_of(rseqs[i])] = tokens[t, :, i]
        batch.begin_token()
        got = [batch.attend(layer, x[layer, :, 0], x[layer, :, 1, :2], x[layer, :, 2, :2])
               for layer in range(SPEC.num_layers)]
        batch.end_token()
        for i in (0, 2):
            single = singles[i]
            single.begin_token()
            for layer in range(SPEC.num_layers):
                y = tokens[t, layer, i]
                want = single.attend(layer, y[0], y[1, :2], y[2, :2])
                if DEVICE == "cpu":
                    assert torch.equal(got[layer][batch.row_of(rseqs[i])], want), (t, layer, i)
                else:
                    torch.testing.assert_close(got[layer][batch.row_of(rseqs[i])], want, atol=2e-3, rtol=2e-3)
            single.end_token()
    batch.verify()
    (bad, staged), (intact, also_staged) = steps[1].cold.counts.tolist(), steps[2].cold.counts.tolist()
    assert 0 < bad <= staged and intact == 0 < also_staged and cpu.integrity_errors == bad
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
