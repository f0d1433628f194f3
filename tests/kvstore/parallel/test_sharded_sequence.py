"""Three gloo processes hold one sequence sharded by ShardPlan and attend over it: every rank returns what one
process holding the whole sequence returns (dense: its plain attention; topk and sketch: its attention over the
ranks' selection, ShardedSelection), through prefill, appends past block boundaries and every mode. Every block stays fp16 (hot) here: each rank's store
places its own shard by its own windows, so with int8 tiers the outputs differ by the int8 rounding of blocks one
store cooled and the other did not (docs/context-parallel.md)."""

from __future__ import annotations

import torch

from kvstore.parallel.group import RankGroup, spawn
from kvstore.parallel.reference import ShardedSelection
from kvstore.parallel.sequence import ShardedSequence
from kvstore.parallel.shards import ShardPlan
from tests.kvstore.parallel.test_shards import SPEC, make_store, random_kv

PREFILL, APPENDS, BUDGET = 250, 12, 96
MODES = ("dense", "topk", "sketch")


def queries(step: int) -> torch.Tensor:
    return (torch.randn(4, 16, generator=torch.Generator().manual_seed(100 + step)) * 3).half()


def run_rank(group: RankGroup) -> dict:
    """Outputs [step][layer][mode] of the sharded sequence and what this rank's store holds."""
    k, v = random_kv(PREFILL + APPENDS, SPEC, 7)
    with make_store(hot_tokens=512) as store:
        sharded = ShardedSequence(store, group, ShardPlan.split(PREFILL, group.world_size, 16))
        outs = []
        for step in range(APPENDS + 1):
            lo, hi = (0, PREFILL) if step == 0 else (PREFILL + step - 1, PREFILL + step)
            for layer in range(SPEC.num_layers):
                sharded.fill(layer, k[lo:hi], v[lo:hi])
            if step % 4 == 0:
                outs.append([[sharded.attend(layer, queries(step), m, BUDGET) for m in MODES]
                             for layer in range(SPEC.num_layers)])
        store.check_integrity()
        return {"outs": outs, "held": store.table(sharded.seq, 1).num_tokens, "lengths": sharded.lengths}


def one_process() -> list:
    k, v = random_kv(PREFILL + APPENDS, SPEC, 7)
    plan = ShardPlan.split(PREFILL, 3, 16)
    outs = []
    with make_store(hot_tokens=512) as store:
        seq = store.create_sequence()
        policies = {m: ShardedSelection(plan, m, store.policies["topk"], store.policies[m]) for m in MODES[1:]}
        for step in range(APPENDS + 1):
            lo, hi = (0, PREFILL) if step == 0 else (PREFILL + step - 1, PREFILL + step)
            for layer in range(SPEC.num_layers):
                store.append(seq, layer, k[lo:hi], v[lo:hi])
            if step % 4 == 0:
                outs.append([[store.attend(seq, layer, queries(step), policies.get(m, m), BUDGET) for m in MODES]
                             for layer in range(SPEC.num_layers)])
    return outs


def test_three_ranks_attend_as_one_process_over_their_selection() -> None:
    ranks = spawn(run_rank, 3, "gloo")
    want = one_process()
    assert [r["held"] for r in ranks] == [80, 80, PREFILL + APPENDS - 160]  # 16 blocks: 5, 5, 6 and the appends
    for r in ranks:
        assert r["lengths"] == [PREFILL + APPENDS] * SPEC.num_layers
        assert all(torch.equal(a, b) for a, b in zip(_flat(r["outs"]), _flat(ranks[0]["outs"])))  # ranks agree
    for got, ref in zip(_flat(ranks[0]["outs"]), _flat(want)):
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-3, rtol=2e-3)


def _flat(outs: list) -> list[torch.Tensor]:
    return [t for step in outs for layer in step for t in layer]
