"""The dense step's tables partitioned by pool between tokens (kvstore/decode/dense_tables.py): partitioned again exactly
when a block moves or the table grows, and every token's kernel gets the partition of the table it reads.

On CPU the store's kernel is the torch reference, which walks no partition: the tests force the partition walk
(step_dense.partition_walk) and check each partition the step hands the kernel against partition_table_ref of
that token's table, and at some tokens the Triton kernel (interpreted) reading it against the reference."""

from __future__ import annotations

import pytest
import torch

from kvstore.decode import dense_tables as step_dense
from kvstore.attention.paged_decode import paged_decode
from kvstore.attention.partition import partition_table_ref
from tests.kvstore.decode.test_step import DEVICE, SPEC, eager_path, make_store, tokens, twin_stores


def test_table_moves_count_every_map_write(tmp_path):
    store = make_store(tmp_path, "a")
    seq = store.create_sequence()
    k = torch.randn(40, 2, 32).half().to(DEVICE)
    store.append(seq, 0, k, k)  # three new blocks (16 tokens each): placed hot
    table = store.table(seq, 0)
    moved = table.moves
    assert moved > 0
    store.append(seq, 0, k[:1], k[:1])  # into the tail block: no map changes
    assert table.moves == moved
    store.append(seq, 0, k[:8], k[:8])  # a fourth block opens
    assert table.moves > moved


def _run_dense_step(tmp_path, monkeypatch, num_tokens: int, interpret_every: int) -> tuple:
    monkeypatch.setattr(step_dense, "partition_walk", lambda device, geom: True)
    eager, stepped, sa, sb = twin_stores(tmp_path, 200, seed=0)
    step = stepped.decode_step(sb, mode="dense", budget=4096, capacity_tokens=1024)
    reference, seen = stepped.decode.kernel, []

    def kernel(q, hot, warm, k_scale, v_scale, table, is_int8, count, partition=None, **kw):
        out = reference(q, hot, warm, k_scale, v_scale, table, is_int8, count, **kw)  # appends the token first
        seen.append(partition)
        assert partition is not None  # both pools, the walk forced: the step hands every layer its partition
        n = -(-int(count[0]) // 16)
        ((num_fp16, slots, positions),) = partition_table_ref(table, is_int8.view(torch.int8), count.cpu(), 16)[0][:1]
        assert int(partition.num_fp16[0, 0]) == num_fp16
        assert torch.equal(partition.slots[0, 0, :n].cpu(), slots)
        assert torch.equal(partition.positions[0, 0, :n].cpu(), positions)
        if len(seen) % interpret_every == 0:  # the Triton walk over the kept partition (token already appended)
            got, _ = paged_decode(q, hot, warm, k_scale, v_scale, table, is_int8, count, walk="partition",
                                  num_splits=2, partition=partition)
            torch.testing.assert_close(got.float(), out[0].float(), atol=2e-3, rtol=2e-3)
        return out

    stepped.decode.kernel = kernel
    work = tokens(num_tokens, seed=1)
    for t in range(num_tokens):
        step.begin_token()
        for layer in range(SPEC.num_layers):
            q, k, v = work[t * SPEC.num_layers + layer]
            eager.append(sa, layer, k[None], v[None])
            want = eager_path(eager, sa, layer, q, "dense")
            got = step.attend(layer, q, k, v)
            torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)
        step.end_token()
    stepped.check_integrity()
    return step, stepped, sb, seen


def test_the_step_partitions_at_block_boundaries_only_and_each_kernel_reads_its_tables_partition(tmp_path,
                                                                                                  monkeypatch):
    """200 -> 240 tokens (16-token blocks, hot window 128: warm blocks throughout): six partitions for 40 tokens,
    each the partition of the table that token reads."""
    step, stepped, _, seen = _run_dense_step(tmp_path, monkeypatch, 40, interpret_every=9)
    assert len(seen) == 40 * SPEC.num_layers
    # the first token; a block cooled by the tokens making 208, 224 and 240 (the hot window's edge crosses a block
    # boundary); a new tail block for the tokens after 208 and 224
    assert step.partitions.partitions == 1 + 3 + 2
    assert stepped.stats()["tiers"]["warm"]["blocks"] > 0


def test_a_block_moved_between_tokens_is_partitioned_again(tmp_path, monkeypatch):
    """A move the step did not make (here: blocks cooled by the store itself between tokens) changes the tables'
    moves: the next token partitions again instead of reading a partition of the old tables."""
    step, stepped, seq, _ = _run_dense_step(tmp_path, monkeypatch, 2, interpret_every=1)
    before = step.partitions.partitions
    table = stepped.table(seq, 0)
    warm = table.num_warm
    stepped.tiers.cool(table, table.num_tokens, table.num_tokens + 32)  # as 32 tokens more would cool: 2 blocks
    assert table.num_warm == warm + 2
    step.begin_token()
    assert step.partitions.partitions == before + 1
    step.begin_token()  # nothing moved since
    assert step.partitions.partitions == before + 1


@pytest.mark.parametrize("both_pools", [False, True])
def test_no_partition_where_the_kernel_walks_none(tmp_path, both_pools):
    """On CPU (the reference kernel), or with one pool, the step keeps no partition and hands the kernel none."""
    store = make_store(tmp_path, "a")
    seq = store.create_sequence()
    for layer in range(SPEC.num_layers):
        k = torch.randn(200, 2, 32).half().to(DEVICE)
        store.append(seq, layer, k, k)
    step = store.decode_step(seq, mode="dense", capacity_tokens=1024)
    step.partitions.update(step.tables, step.dense_blocks, step.length + 1, both_pools)
    assert (step.partitions.of_layer(0) is not None) == (both_pools and DEVICE == "cuda" and
                                                         step_dense.partition_walk(store.device, _geom(step)))


def _geom(step):
    from kvstore.attention.plan import DecodeGeometry

    s = step.spec
    return DecodeGeometry(1, s.num_q_heads, s.num_kv_heads, s.head_dim, step.block_tokens, step.dense_blocks)


@pytest.mark.cuda
def test_a_long_mixed_dense_step_partitions_between_tokens_not_in_them(tmp_path, monkeypatch):
    """80K tokens x 2 kv heads (the split walk), the blocks past a 40K hot window warm: the eager kernel partitions
    the table in every call, the step once before its first token (nothing moves in the next two); same outputs."""
    import kvstore.attention.partition as partition_module  # what paged_decode partitions with (not step_dense)

    calls = []
    real = partition_module.partition_table
    monkeypatch.setattr(partition_module, "partition_table", lambda *a, **k: calls.append(1) or real(*a, **k))
    ctx = 80_000
    big = dict(hot_tokens=40_000, warm_tokens=60_000, gpu_bytes=96 << 20, cpu_bytes=16 << 20)
    eager, stepped, sa, sb = twin_stores(tmp_path, ctx, seed=3, **big)
    assert stepped.table(sb, 0).num_warm > 0
    step = stepped.decode_step(sb, mode="dense", budget=4096, capacity_tokens=ctx + 256)
    work = tokens(3, seed=4)
    for t in range(3):
        step.begin_token()
        assert step.graph_key()[-1] is False and step.partitions.of_layer(0) is not None
        for layer in range(SPEC.num_layers):
            q, k, v = work[t * SPEC.num_layers + layer]
            eager.append(sa, layer, k[None], v[None])
            before = len(calls)
            want = eager_path(eager, sa, layer, q, "dense")
            assert len(calls) == before + 1  # the eager kernel partitioned the table
            got = step.attend(layer, q, k, v)
            assert len(calls) == before + 1  # the step's kernel read the kept partition
            torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)
        step.end_token()
    assert step.partitions.partitions == 1
    stepped.check_integrity()
    eager.close(), stepped.close()
