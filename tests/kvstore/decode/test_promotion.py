"""The captured step's promotion (kvstore/decode/promotion.py): cpu blocks the step keeps reading move up to the
warm tier at block boundaries, into free slots or by swapping out the sequence's least attended warm block;
fewer slices are staged per token afterwards, and the outputs are bit-equal to the same run with promotion off."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvstore.blocks.tierset import CPU_TIER, WARM_TIER
from kvstore.decode.promotion import StepPromotion
from tests.kvstore.decode.test_step import SPEC, cold_pair, tokens

# the warm pool full of the sequence's warm window (free slots: none), most of the 600 tokens in the cpu tier
FULL = dict(gpu_bytes=160 << 10, warm_tokens=256)
THRESHOLD = 2 * SPEC.num_kv_heads  # PROMOTE_AFTER whole blocks' worth of head slices


def decode(store, seq: int, num_tokens: int, seed: int = 6, last_end: bool = True, budget: int = 128):
    """num_tokens through the sequence's DecodeStep: (the step, outputs of every token and layer, slices staged by
    each token). last_end=False: the last token's end_token (a block boundary, when it fills the tails) is left
    to the caller."""
    step = store.decode_step(seq, mode="topk", budget=budget)
    work, outputs, staged, seen = tokens(num_tokens, seed), [], [], 0
    for t in range(num_tokens):
        step.begin_token()
        for layer in range(SPEC.num_layers):
            outputs.append(step.attend(layer, *work[t * SPEC.num_layers + layer]))
        if t < num_tokens - 1 or last_end:
            step.end_token()
        total = int(step.cold.counts[1])  # head slices the step staged so far (its device counter)
        staged.append(total - seen)
        seen = total
    return step, outputs, staged


@pytest.mark.parametrize("pool", ["free slots", "full"])
def test_promoted_blocks_stop_being_staged_and_the_outputs_stay_bit_equal(tmp_path, pool):
    overrides = FULL if pool == "full" else {}
    _, on, (_, a) = cold_pair(tmp_path, "on", **overrides)
    _, off, (_, b) = cold_pair(tmp_path, "off", promotions_per_boundary=0, **overrides)
    assert (on.tiers.warm.free_blocks() == 0) == (pool == "full")
    on_step, got, staged_on = decode(on, a, 48)  # 600 -> 648: boundaries at 608, 624, 640
    off_step, want, staged_off = decode(off, b, 48)
    on_step.verify(), off_step.verify()
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    for layer in range(SPEC.num_layers):  # the same values stored: a promoted block keeps its int8 bytes
        assert all(torch.equal(x, y) for x, y in zip(on.read(a, layer), off.read(b, layer)))
    stats = on.stats()["attend"]
    assert stats["promotions"] > 0 and off.stats()["attend"]["promotions"] == 0
    if pool == "full":  # every promotion was a swap: the sequence's least attended warm blocks went to cpu
        assert stats["promotion_swaps"] == stats["promotions"]
    else:
        assert stats["promotion_swaps"] == 0
    # before the first boundary both staged the same; after a few, the promoting step stages fewer slices
    assert staged_on[:8] == staged_off[:8]
    assert sum(staged_on[-16:]) < sum(staged_off[-16:])
    assert sum(staged_on[-16:]) / 16 < sum(staged_on[:8]) / 8
    on.check_integrity(), off.check_integrity()
    on.close(), off.close()


def test_a_full_warm_pool_swaps_out_the_least_attended_block_never_a_protected_one(tmp_path):
    """hot_tokens 32 with a 64-token recent window (a budget of 512): the window's older blocks lie in the warm
    tier. The least attended movable warm block goes to cpu (same bytes, verified there); recent-window blocks
    attended even less stay."""
    # staging rows for 512 tokens, not 128 (408 bytes a token: fp16 and int8 slots): the same full warm pool
    full = {**FULL, "gpu_bytes": FULL["gpu_bytes"] + (512 - 128) * 408}
    _, store, (_, seq) = cold_pair(tmp_path, **full, hot_tokens=32, recent_tokens=64, staging_tokens=512)
    tiers = store.tiers
    # 600 -> 608: the 8th token's end_token is the boundary
    step, _, _ = decode(store, seq, 8, last_end=False, budget=512)
    tables = [store.table(seq, layer) for layer in range(SPEC.num_layers)]
    n = tables[0].num_blocks
    assert step.recent_tokens == 64
    first_kept = (608 - 64) // 16  # blocks of the last 64 tokens (and the sinks, the tail) are never moved down
    warm = [(layer, i) for layer, t in enumerate(tables) for i in range(n) if int(t.tier_map[i]) == WARM_TIER]
    movable = [(layer, i) for layer, i in warm if 1 <= i < first_kept]
    kept = [(layer, i) for layer, i in warm if not 1 <= i < first_kept]
    assert movable and kept and tiers.warm.free_blocks() == 0
    reads = step.cold.reads
    assert any(int(reads[layer, i]) >= THRESHOLD and int(t.tier_map[i]) == CPU_TIER
               for layer, t in enumerate(tables) for i in range(n))  # a block to promote
    victim = movable[len(movable) // 2]
    for layer, i in movable:  # worth more than any cpu block can have gathered in 8 tokens
        tables[layer].h2o_scores[:, i] = 1e6
    for layer, i in kept + [victim]:
        tables[layer].h2o_scores[:, i] = 0.0
    block = tables[victim[0]].block_ids[victim[1]]
    warm_bytes = tiers.warm.get([block]).tensors()
    cpu_before = {b for t in tables for b in t.block_ids if tiers.blocks.tier_of[b] == CPU_TIER}
    cpu_bytes = {b: tiers.cpu.get([b]).tensors() for b in cpu_before}
    step.end_token()
    assert tiers.blocks.tier_of[block] == CPU_TIER
    assert all(tiers.blocks.tier_of[tables[layer].block_ids[i]] == WARM_TIER for layer, i in movable + kept
               if (layer, i) != victim)
    stats = store.stats()["attend"]
    assert stats["promotions"] == stats["promotion_swaps"] == 1 and tiers.warm.free_blocks() == 0
    assert all(torch.equal(x, y.cpu()) for x, y in zip(tiers.cpu.get([block]).tensors(), warm_bytes))  # verified
    (promoted,) = [b for b in cpu_before if tiers.blocks.tier_of[b] == WARM_TIER]
    assert all(torch.equal(x.cpu(), y) for x, y in zip(tiers.warm.get([promoted]).tensors(), cpu_bytes[promoted]))
    store.check_integrity()
    store.close()


def test_a_boundary_promotes_at_most_its_limit_most_read_first_and_the_rest_keep_half_their_counts(tmp_path):
    _, store, (_, seq) = cold_pair(tmp_path, promotions_per_boundary=1)
    step, _, _ = decode(store, seq, 8, last_end=False)
    tables = [store.table(seq, layer) for layer in range(SPEC.num_layers)]
    before = step.cold.reads.clone()
    waiting = [(layer, i) for layer, i in torch.nonzero(before >= THRESHOLD).tolist()
               if int(tables[layer].tier_map[i]) == CPU_TIER]
    assert len(waiting) > 1
    step.end_token()
    (promoted,) = [(layer, i) for layer, i in waiting if int(tables[layer].tier_map[i]) == WARM_TIER]
    assert int(before[promoted]) == max(int(before[e]) for e in waiting)
    want = before >> 1
    want[promoted] = 0  # its count restarts; the others, still in cpu, carry half of theirs to the next boundary
    assert torch.equal(step.cold.reads, want)
    assert store.stats()["attend"]["promotions"] == 1
    store.check_integrity()
    store.close()


def test_an_fp16_cpu_tier_is_never_promoted_by_the_step(tmp_path):
    """Promoting an fp16 cpu block would quantize it: the step would attend other values than before."""
    _, store, (_, seq) = cold_pair(tmp_path, cpu_dtype="float16", cpu_bytes=32 << 20)
    tier_of = store.tiers.blocks.tier_of
    in_cpu = lambda: {b for b, t in tier_of.items() if t == CPU_TIER}  # noqa: E731
    before = in_cpu()
    step, _, staged = decode(store, seq, 8)  # through the boundary at 608 (which cools one more block per layer)
    step.verify()
    assert sum(staged) > 0 and store.stats()["attend"]["promotions"] == 0
    assert before < in_cpu()
    store.close()


@pytest.mark.parametrize("layers,capacity,limit", [(3, 37, 5), (5, 130, 1000)])
def test_the_device_picks_what_the_registry_says_most_read_first(layers, capacity, limit):
    """StepPromotion._wanted against its reference: the counted entries whose block the registry has in the cpu
    tier, most read first (ties in (layer, index) order), at most the limit; the other counted ones restart."""
    g = torch.Generator().manual_seed(capacity)
    reads = torch.randint(0, 3 * THRESHOLD, (layers, capacity), generator=g, dtype=torch.int32)
    tiers = torch.randint(0, 4, (layers, capacity), generator=g).to(torch.int8)  # hot, warm, cpu, cold
    tables = [SimpleNamespace(block_ids=list(range(l * capacity, (l + 1) * capacity)), tier_map=tiers[l])
              for l in range(layers)]
    tier_of = {l * capacity + i: int(tiers[l, i]) for l in range(layers) for i in range(capacity)}
    pick = StepPromotion.__new__(StepPromotion)
    pick.cold, pick.threshold, pick.limit = SimpleNamespace(reads=reads), THRESHOLD, limit
    wanted, gone = pick._wanted(tables)
    counted = sorted(((int(reads[l, i]), l, i) for l in range(layers) for i in range(capacity)
                      if reads[l, i] >= THRESHOLD), key=lambda e: -e[0])  # stable: (layer, index) order kept
    in_cpu = [(l, i) for _, l, i in counted if tier_of[tables[l].block_ids[i]] == CPU_TIER]
    assert wanted == in_cpu[:limit] and len(in_cpu) > 0
    assert sorted(map(tuple, gone.nonzero().tolist())) == sorted((l, i) for _, l, i in counted
                                                                 if tier_of[l * capacity + i] != CPU_TIER)
