"""The store's key sketch: kept for every block whatever its tier, used by mode='sketch' (norm-matched needles in
warm and cpu tiers are found), certified omitted mass never below the true one, the adaptive epsilon mode."""

from __future__ import annotations

import pytest
import torch

from eviction.sketch import sketch_keys
from kvstore import Config, KVStore, ModelSpec

SPEC = ModelSpec(num_layers=1, num_q_heads=6, num_kv_heads=2, head_dim=32)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_store(tmp_path, **overrides) -> KVStore:
    base = dict(model=SPEC, block_tokens=16, sink_tokens=16, hot_tokens=128, warm_tokens=512, recent_tokens=64,
                gpu_bytes=2 << 20, cpu_bytes=4 << 20, ssd_path=str(tmp_path / "ssd"), ssd_bytes=64 << 20,
                staging_tokens=1024, device=DEVICE, host_memory_reserve=0)
    return KVStore(Config(**{**base, **overrides}))


def haystack(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Keys with a shared mean and outlier channels; per kv head 4 needles as far from the mean as a typical key,
    at 45 degrees from the group's query (extreme in no channel). Returns q [Hq, D], k, v [T, H, D], needle tokens."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_tokens, 2, 32, generator=g)
    k[..., :4] *= 5.0
    radius = k.norm(dim=-1).median()
    mean = 2.0 * torch.randn(32, generator=g)
    k += mean
    q = (torch.randn(2, 1, 32, generator=g) + 0.5 * torch.randn(2, 3, 32, generator=g)).view(6, 32) * 2  # GQA groups
    positions = [300, 700, 1100, 1700]
    for head in range(2):
        along = torch.nn.functional.normalize(q[3 * head: 3 * head + 3].mean(0), dim=0)
        for pos in positions:
            across = torch.randn(32, generator=g)
            across = torch.nn.functional.normalize(across - (across @ along) * along, dim=0)
            k[pos, head] = mean + radius * (0.7 * along + 0.51**0.5 * across)
    v = torch.randn(num_tokens, 2, 32, generator=g)
    return q.half().to(DEVICE), k.half().to(DEVICE), v.half().to(DEVICE), positions


def fill(store: KVStore, k: torch.Tensor, v: torch.Tensor) -> int:
    seq = store.create_sequence()
    store.append(seq, 0, k[:1000], v[:1000])
    for t in range(1000, 1040):  # token by token across block boundaries
        store.append(seq, 0, k[t:t + 1], v[t:t + 1])
    for start in range(1040, k.shape[0], 97):
        store.append(seq, 0, k[start:start + 97], v[start:start + 97])
    return seq


def test_every_full_block_has_the_sketch_of_its_keys(tmp_path):
    store = make_store(tmp_path)
    q, k, v, _ = haystack(3003, seed=0)
    seq = fill(store, k, v)
    table = store.table(seq, 0)
    summaries, codes = (x.cpu() for x in sketch_keys(k, 16))  # on the store's device: the same rounding
    full = table.num_tokens // 16
    assert torch.equal(table.summaries[: table.num_blocks].cpu(), summaries)
    assert torch.equal(table.sketch[:full].cpu(), codes[:full])
    tiers = store.stats()["tiers"]
    assert tiers["warm"]["blocks"] > 0 and tiers["cpu"]["blocks"] > 0  # the sketch covers every tier
    store.check_integrity()


def test_topk_finds_norm_matched_needles_the_min_max_bound_misses(tmp_path):
    store = make_store(tmp_path)
    q, k, v, positions = haystack(3003, seed=1)
    seq = fill(store, k, v)
    logits = torch.einsum("hgd,thd->hgt", q.float().view(2, 3, 32), k.float()).flatten(0, 1) / 32**0.5
    weight = torch.softmax(logits, dim=1)[:, positions]  # [Hq, 4]
    assert float(weight.min()) > 0.01  # each needle matters to dense attention
    found = {}
    for mode in ("sketch", "topk"):
        before = store.stats()["attend"]["mass_captured"]
        store.attend(seq, 0, q, mode=mode, budget=16 * 20, measure_mass=True)
        found[mode] = store.stats()["attend"]["mass_captured"] - before
    assert found["sketch"] > 0.9 and found["topk"] < found["sketch"] - 0.1
    attend = store.stats()["attend"]
    assert attend["certified_calls"] == 1 and attend["certified_measured"] == 1
    assert attend["certificate_violations"] == 0
    assert attend["certified_omitted"] >= attend["true_omitted"] > 0


@pytest.mark.parametrize("seed", range(4))
def test_certified_omitted_mass_is_never_below_the_true_one(tmp_path, seed):
    store = make_store(tmp_path)
    q, k, v, _ = haystack(2000 + 77 * seed, seed=seed)
    seq = fill(store, k, v)
    g = torch.Generator().manual_seed(seed)
    for budget in (96, 256, 640):
        for scale in (0.5, 1.0, 3.0):
            query = (q.float().cpu() * scale + torch.randn(6, 32, generator=g)).half().to(DEVICE)
            store.attend(seq, 0, query, mode="sketch", budget=budget, measure_mass=True)
    attend = store.stats()["attend"]
    assert attend["certified_measured"] == 9 and attend["certificate_violations"] == 0
    store.check_integrity()


def test_adaptive_mode_reads_until_the_bound_holds(tmp_path):
    store = make_store(tmp_path)
    q, k, v, _ = haystack(3003, seed=2)
    seq = fill(store, k, v)
    read, bound = {}, {}
    for epsilon in (0.5, 0.05, 0.005):
        before = store.stats()["attend"]
        store.attend(seq, 0, q, mode="sketch", budget=3003, epsilon=epsilon)
        after = store.stats()["attend"]
        read[epsilon] = after["attended_tokens"] - before["attended_tokens"]
        bound[epsilon] = after["certified_omitted"] - before["certified_omitted"]
    assert read[0.5] <= read[0.05] <= read[0.005] and read[0.5] < read[0.005]
    for epsilon in (0.5, 0.05):
        assert bound[epsilon] <= epsilon or read[epsilon] == 3003  # met, or the whole budget was read
    with pytest.raises(ValueError, match="epsilon"):
        store.attend(seq, 0, q, mode="sketch", budget=512, epsilon=1.5)
    with pytest.raises(ValueError, match="epsilon"):
        store.attend(seq, 0, q, mode="window", budget=512, epsilon=0.1)


def test_a_fork_reads_the_same_sketch_and_selects_the_same_blocks(tmp_path):
    store = make_store(tmp_path)
    q, k, v, _ = haystack(2500, seed=3)
    seq = fill(store, k, v)
    twin = store.fork(seq)
    a, b = store.table(seq, 0), store.table(twin, 0)
    assert torch.equal(a.sketch[: a.num_blocks], b.sketch[: b.num_blocks])
    outs = [store.attend(s, 0, q, mode="sketch", budget=320) for s in (seq, twin)]
    assert torch.equal(outs[0], outs[1])
    store.check_integrity()


def test_captured_step_codes_each_block_it_fills(tmp_path):
    """DecodeStep appends inside the (captured) step; at each block boundary it codes the block just filled; it
    certifies its omitted mass as the eager path does."""
    store = make_store(tmp_path, warm_tokens=2048)  # nothing goes cold: the step serves every token
    q, k, v, _ = haystack(2000, seed=4)
    seq = store.create_sequence()
    store.append(seq, 0, k[:600], v[:600])
    step = store.decode_step(seq, mode="sketch", budget=160, capacity_tokens=1024)
    for t in range(600, 700):  # 600 -> 700 tokens: blocks 37 .. 43 filled by the step
        step.begin_token()
        step.attend(0, q, k[t], v[t])
        step.end_token()
    step_bound = float(step.certified[0].mean())  # the last token's certified omitted mass, from the step
    attend = store.stats()["attend"]
    assert attend["certified_calls"] > 0 and 0 < attend["mean_certified_omitted"] <= 1
    before = attend["certified_omitted"]
    store.attend(seq, 0, q, mode="sketch", budget=160)  # the eager path on the same 700 tokens, same query
    assert abs(store.stats()["attend"]["certified_omitted"] - before - step_bound) < 1e-4
    step.begin_token()  # the boundary work of the next token codes the last block filled
    table = store.table(seq, 0)
    codes = sketch_keys(k[:700], 16)[1].cpu()  # the fp16 keys as appended, coded on the store's device
    full = 700 // 16
    assert torch.equal(table.sketch[:full].cpu(), codes[:full])


def test_a_sequence_started_on_a_held_prefix_reads_its_sketch(tmp_path):
    store = make_store(tmp_path)
    q, k, v, _ = haystack(2000, seed=5)
    doc = list(range(5, 805))  # 800 tokens: 50 full blocks
    base = store.create_sequence()
    store.extend_tokens(base, doc)
    store.append(base, 0, k[:800], v[:800])
    match = store.match_prefix(doc[:700] + [9] * 40)
    assert match.num_tokens == 688  # 43 whole blocks
    seq = store.create_sequence(prefix=match)
    a, b = store.table(base, 0), store.table(seq, 0)
    assert torch.equal(b.sketch[:43], a.sketch[:43])
    assert torch.equal(b.sketch[:43].cpu(), sketch_keys(k[:688], 16)[1].cpu())  # coded on the store's device
    store.check_integrity()
