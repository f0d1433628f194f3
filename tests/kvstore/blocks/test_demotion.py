"""Demotion.victims: which blocks of a full tier cool first. The least attended of the oldest go first, a block
shared by two sequences worth what its most attending holder gives it; the worths of all candidates are read in
one gather, and rank exactly as each block's own scores do."""

from __future__ import annotations

import torch

from eviction.h2o import H2O
from kvstore import Config, KVStore, ModelSpec
from kvstore.blocks.tierset import WARM_TIER

SPEC = ModelSpec(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16)


def one_by_one(store: KVStore, ids: list[int]) -> list[float]:
    """Each block's worth from its holders' own score columns, one block at a time."""
    tables_of = store.tiers.holders.tables_of
    return [max(float(H2O().block_worth(t.h2o_scores[:, i: i + 1])[0]) for t, i in tables_of(b)) for b in ids]


def test_victims_are_the_least_attended_of_the_oldest_shared_blocks_worth_their_best_holder(tmp_path):
    config = Config(model=SPEC, block_tokens=16, sink_tokens=16, hot_tokens=32, warm_tokens=1 << 20,
                    gpu_bytes=8 << 20, cpu_bytes=8 << 20, device="cpu", host_memory_reserve=0)
    g = torch.Generator().manual_seed(0)
    with KVStore(config) as store:
        seqs = []
        for length in (400, 272):
            seq = store.create_sequence()
            k, v = (torch.randn(length, 2, 16, generator=g).half() for _ in range(2))
            for layer in range(SPEC.num_layers):
                store.append(seq, layer, k, v)
            seqs.append(seq)
        seqs.append(store.fork(seqs[0]))  # shares every full block of the first sequence
        for seq in seqs:
            for layer in range(SPEC.num_layers):
                store.table(seq, layer).h2o_scores.uniform_(0, 1, generator=g)
        demotion, tables_of = store.tiers.demotion, store.tiers.holders.tables_of
        warm = list(store.tiers.blocks.oldest(WARM_TIER))
        assert any(len(list(tables_of(b))) == 2 for b in warm)
        worth = demotion.worths(warm)
        assert worth == one_by_one(store, warm)
        shared = next(b for b in warm if len(list(tables_of(b))) == 2)
        assert worth[warm.index(shared)] == max(float(t.h2o_scores[:, i].amax()) for t, i in tables_of(shared))
        for n in (1, 7, 40):
            candidates = demotion.placement.victims(store.tiers.blocks.oldest(WARM_TIER), 4 * n, demotion.is_pinned,
                                                    demotion.is_protected)
            want = [b for _, b in sorted(zip(one_by_one(store, candidates), candidates), key=lambda x: x[0])][:n]
            assert demotion.victims(WARM_TIER, n) == want
