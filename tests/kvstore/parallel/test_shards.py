"""The shard plan, the budget rule and the one-process pieces of a sharded sequence: a group of one rank equals
the store's own attend; the merge of shards equals attention over the whole; the ranks' top-K selections
together contain the one-process selection."""

from __future__ import annotations

import pytest
import torch

from kvstore import Config, KVStore, ModelSpec
from kvstore.attention.reference import paged_decode_ref
from kvstore.parallel.group import RankGroup
from kvstore.parallel.merge import merge_partials
from kvstore.parallel.reference import ShardedSelection
from kvstore.parallel.sequence import ShardedSequence
from kvstore.parallel.shards import ShardPlan, allot_free_blocks

SPEC = ModelSpec(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16)


def make_store(spec: ModelSpec = SPEC, **overrides) -> KVStore:
    settings = dict(model=spec, block_tokens=16, sink_tokens=16, hot_tokens=64, warm_tokens=128, recent_tokens=32,
                    gpu_bytes=8 << 20, cpu_bytes=8 << 20, device="cpu") | overrides
    return KVStore(Config(**settings))


def random_kv(num_tokens: int, spec: ModelSpec, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn((num_tokens, spec.num_kv_heads, spec.head_dim), generator=g)
    k[..., :3] *= 5  # outlier channels, so bounds differ between blocks
    return k.half(), torch.randn(k.shape, generator=g).half()


def test_plan_splits_blocks_evenly_and_the_last_rank_owns_the_tail() -> None:
    plan = ShardPlan.split(200, 3, 16)  # 13 blocks
    assert plan.starts == (0, 4, 8)
    assert plan.token_range(0) == (0, 64) and plan.token_range(2) == (128, float("inf"))
    assert [plan.owner(p) for p in (0, 63, 64, 127, 128, 10_000)] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="fewer than"):
        ShardPlan.split(40, 4, 16)
    with pytest.raises(ValueError, match="strictly increase"):
        ShardPlan(16, (0, 3, 3))


def test_budget_rule_gives_each_rank_its_largest_count_of_the_global_top() -> None:
    inf = float("-inf")
    gathered = torch.tensor([[[9.0, 8.0, 1.0], [5.0, inf, inf]],  # rank 0: head 0, head 1
                             [[7.0, 6.0, 0.0], [4.0, 3.0, 2.0]]])  # rank 1
    # k_free 3: head 0 takes 9, 8 (rank 0), 7 (rank 1); head 1 takes 5 (rank 0), 4, 3 (rank 1)
    assert allot_free_blocks(gathered, 3).tolist() == [2, 2]
    assert allot_free_blocks(gathered[:, :, :0], 0).tolist() == [0, 0]
    with pytest.raises(ValueError, match="gathered"):
        allot_free_blocks(gathered, 2)


@pytest.mark.parametrize("mode", ["dense", "topk", "sketch"])
def test_one_rank_attends_as_the_store_does(mode: str) -> None:
    k, v = random_kv(300, SPEC, 1)
    q = torch.randn(4, 16, generator=torch.Generator().manual_seed(2)).half() * 3
    with make_store() as whole, make_store() as shard_store:
        seq = whole.create_sequence()
        sharded = ShardedSequence(shard_store, RankGroup(), ShardPlan.split(300, 1, 16))
        for layer in range(2):
            whole.append(seq, layer, k, v)
            sharded.fill(layer, k, v)
        want = whole.attend(seq, 1, q, mode=mode, budget=96)
        got = sharded.attend(1, q, mode=mode, budget=96)
        assert torch.equal(got, want)
        assert torch.equal(shard_store.table(sharded.seq, 1).h2o_scores, whole.table(seq, 1).h2o_scores)
        shard_store.check_integrity()


def test_merging_shards_equals_attention_over_the_whole() -> None:
    """Two shards' (out, lse) from the paged kernel's reference merge into the whole table's output."""
    g = torch.Generator().manual_seed(3)
    pool = torch.randn((9, 2, 2, 16, 16), generator=g).half()  # [slots, K/V, H, T, D]
    q = (torch.randn((1, 4, 16), generator=g) * 2).half()
    table = torch.tensor([[[4, 0, 7, 2, 5, 8], [1, 3, 6, 0, 2, 4]]], dtype=torch.int32)
    no_warm = (torch.zeros((1, 2, 2, 16, 16), dtype=torch.int8), torch.ones(1, 2, 16), torch.ones(1, 2, 16))
    full = paged_decode_ref(q, pool, *no_warm, table, torch.zeros_like(table, dtype=torch.bool),
                            torch.tensor([90], dtype=torch.int32))[0][0]
    parts = []
    for cols, n in ((slice(0, 2), 32), (slice(2, 6), 58)):
        lse = torch.empty((1, 4))
        t = table[:, :, cols].contiguous()
        out = paged_decode_ref(q, pool, *no_warm, t, torch.zeros_like(t, dtype=torch.bool), torch.tensor([n], dtype=torch.int32),
                               lse_out=lse)[0]
        parts.append((out[0], lse[0]))
    outs, lses = torch.stack([o.float() for o, _ in parts]), torch.stack([lse for _, lse in parts])
    merged = merge_partials(outs, lses)
    torch.testing.assert_close(merged.float(), full.float(), atol=2e-3, rtol=2e-3)
    lses[0, 1] = float("-inf")  # a rank that attended nothing for a head: weight 0 (both merges alike)
    torch.testing.assert_close(merge_partials(outs, lses, use_kernel=True).float(),
                               merge_partials(outs, lses, use_kernel=False).float(), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_ranks_topk_selections_contain_the_one_process_selection(num_kv_heads: int) -> None:
    """With one kv head the union is exactly the one-process selection; with more it contains it, within
    world_size times the unprotected budget."""
    spec = ModelSpec(num_layers=1, num_q_heads=4, num_kv_heads=num_kv_heads, head_dim=16)
    k, v = random_kv(600, spec, 4)
    with make_store(spec) as store:
        seq = store.create_sequence()
        store.append(seq, 0, k, v)
        plan = ShardPlan.split(600, 3, 16)
        union_policy = ShardedSelection(plan, "topk", store.policies["topk"], store.policies["topk"])
        table = store.table(seq, 0)
        for trial in range(6):
            q = (torch.randn(4, 16, generator=torch.Generator().manual_seed(10 + trial)) * 3).half()
            ctx = store.decode.context(table, q, 160)
            one = store.policies["topk"].select(ctx, 160)
            union = union_policy.select(ctx, 160)
            assert union.shape[1] <= ctx.window.num_protected() + 3 * (one.shape[1] - ctx.window.num_protected())
            for h in range(num_kv_heads):
                assert set(one[h].tolist()) <= set(union[h].tolist())
                assert union[h].tolist() == sorted(set(union[h].tolist()))  # ascending, no repeats
            if num_kv_heads == 1:
                assert torch.equal(union, one)
