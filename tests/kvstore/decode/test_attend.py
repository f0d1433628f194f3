"""store.attend: dense is exact, top-K with a covering budget is dense, needles are found,
cold blocks are staged and promoted, H2O drop-mode drops, bad queries are refused."""

from __future__ import annotations

import pytest
import torch

from kvstore import Config, KVStore, ModelSpec
from kvstore.decode.eager import AttendStats

SPEC = ModelSpec(num_layers=1, num_q_heads=6, num_kv_heads=2, head_dim=32)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU: the Triton kernels and pinned fetches


def make_store(tmp_path, **overrides) -> KVStore:
    base = dict(model=SPEC, block_tokens=16, sink_tokens=16, hot_tokens=64, warm_tokens=128, recent_tokens=32,
                gpu_bytes=1 << 20, cpu_bytes=64 << 10, ssd_path=str(tmp_path / "ssd"), ssd_bytes=64 << 20,
                staging_tokens=256, device=DEVICE, host_memory_reserve=0)
    return KVStore(Config(**{**base, **overrides}))


def filled(store: KVStore, tokens: int, seed: int = 0) -> tuple[int, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn((tokens, 2, 32), generator=g).half().to(DEVICE)
    v = torch.randn((tokens, 2, 32), generator=g).half().to(DEVICE)
    seq = store.create_sequence()
    for start in range(0, tokens, 97):  # irregular chunks: partial blocks everywhere
        store.append(seq, 0, k[start:start + 97], v[start:start + 97])
    return seq, k, v


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp32 softmax attention of q [Hq, D] over k, v [T, H, D] (GQA)."""
    group = q.shape[0] // k.shape[1]
    k, v = (x.float().repeat_interleave(group, dim=1) for x in (k, v))  # [T, Hq, D]
    p = torch.einsum("hd,thd->ht", q.float(), k).div(q.shape[1] ** 0.5).softmax(-1)
    return torch.einsum("ht,thd->hd", p, v)


def test_dense_matches_attention_over_what_read_returns(tmp_path):
    store = make_store(tmp_path)
    seq, _, _ = filled(store, 1001)
    assert store.stats()["tiers"]["cpu"]["blocks"] > 0  # some blocks are cold: they get staged
    q = torch.randn(6, 32).half().to(DEVICE)
    out = store.attend(seq, 0, q, mode="dense")
    want = dense_reference(q, *store.read(seq, 0))
    assert torch.allclose(out.float(), want, atol=2e-3, rtol=1e-2)
    store.check_integrity()


@pytest.mark.parametrize("mode", ["topk", "window", "h2o"])
def test_budget_covering_everything_equals_dense(tmp_path, mode):
    store = make_store(tmp_path)
    seq, _, _ = filled(store, 700, seed=1)
    q = torch.randn(6, 32).half().to(DEVICE)
    dense = store.attend(seq, 0, q, mode="dense")
    sparse = store.attend(seq, 0, q, mode=mode, budget=1 << 20)
    assert torch.allclose(sparse.float(), dense.float(), atol=1e-3)


def test_topk_finds_a_planted_needle_with_a_small_budget(tmp_path):
    store = make_store(tmp_path)
    tokens, needle = 2000, 777
    g = torch.Generator().manual_seed(2)
    k = torch.randn((tokens, 2, 32), generator=g).half()
    v = torch.randn((tokens, 2, 32), generator=g).half()
    q = torch.randn(6, 32, generator=g)
    k[needle] = (q.view(2, 3, 32).mean(1) * 3).half()  # a key aligned with its group's queries
    v[needle] = 10.0
    seq = store.create_sequence()
    store.append(seq, 0, k.to(DEVICE), v.to(DEVICE))
    q = q.to(DEVICE)
    out = store.attend(seq, 0, q.half(), mode="topk", budget=128, measure_mass=True)
    assert out.float().mean() > 5  # the needle's value dominates: its block was selected
    topk = store.stats()["attend"]
    store.decode.stats = AttendStats()
    window = store.attend(seq, 0, q.half(), mode="window", budget=128, measure_mass=True)
    assert window.float().mean() < 1  # the negative control misses it
    assert topk["read_fraction"] < 0.1
    assert topk["mean_mass_captured"] > 3 * store.stats()["attend"]["mean_mass_captured"]


def test_cold_blocks_are_staged_then_promoted(tmp_path):
    store = make_store(tmp_path)
    seq, k, v = filled(store, 1500, seed=3)
    q = (k[300].float().repeat_interleave(3, dim=0) * 4).half()  # points at block 18, long cold
    table = store.sequences[seq][0]
    assert store.tiers.blocks.tier_of[table.block_ids[300 // 16]] >= 2
    for _ in range(2):
        store.attend(seq, 0, q, mode="topk", budget=96)
    assert store.stats()["attend"]["cold_blocks_fetched"] > 0 and store.stats()["attend"]["promotions"] > 0
    assert store.tiers.blocks.tier_of[table.block_ids[300 // 16]] == 1  # promoted to warm
    store.check_integrity()


@pytest.mark.parametrize("limit", [512, 4])
def test_dense_attends_over_a_full_warm_tier_trade_blocks_only_for_less_attended_ones(tmp_path, limit):
    """Dense attention reads every block every call: a promotion may trade a cpu block for a warm block that
    received less attention, at most the per-call limit, and the trading settles instead of moving the same
    blocks up and down call after call (the fetches per call stay the same either way)."""
    store = make_store(tmp_path, gpu_bytes=240 << 10, warm_tokens=4096, cpu_bytes=1 << 20,
                       promotions_per_boundary=limit)
    seq, _, _ = filled(store, 1500, seed=5)
    cold = store.stats()["tiers"]["cpu"]["blocks"]
    assert cold > 0 and store.tiers.warm.free_blocks() == 0  # the warm tier is full: promoting means swapping
    q = torch.randn(6, 32, generator=torch.Generator().manual_seed(5)).half().to(DEVICE)
    moved = []
    for _ in range(20):
        before = store.stats()["attend"]["promotions"]
        out = store.attend(seq, 0, q, mode="dense")
        moved.append(store.stats()["attend"]["promotions"] - before)
    assert max(moved) <= store.decode.promote_limit == limit and sum(moved) > 0  # one layer: the whole limit a call
    assert sum(moved) <= cold and moved[-3:] == [0, 0, 0]
    stats = store.stats()["attend"]
    assert stats["promotion_swaps"] == stats["promotions"]
    assert torch.allclose(out.float(), dense_reference(q, *store.read(seq, 0)), atol=2e-3, rtol=1e-2)
    store.check_integrity()


def test_h2o_drop_mode_frees_blocks_for_good(tmp_path):
    store = make_store(tmp_path)
    seq, _, _ = filled(store, 800, seed=4)
    before = sum(t["blocks"] for t in store.stats()["tiers"].values())
    store.attend(seq, 0, torch.randn(6, 32).half().to(DEVICE), mode="h2o", budget=256)
    after = sum(t["blocks"] for t in store.stats()["tiers"].values())
    assert after == 256 // 16 < before
    with pytest.raises(ValueError, match="h2o"):
        store.attend(seq, 0, torch.randn(6, 32).half().to(DEVICE), mode="dense")
    with pytest.raises(ValueError, match="dropped"):
        store.read(seq, 0)
    store.append(seq, 0, torch.randn(40, 2, 32).half().to(DEVICE), torch.randn(40, 2, 32).half().to(DEVICE))
    store.attend(seq, 0, torch.randn(6, 32).half().to(DEVICE), mode="h2o", budget=256)
    store.check_integrity()
    store.free(seq)
    assert all(t["blocks"] == 0 for t in store.stats()["tiers"].values())


@pytest.mark.parametrize("q, mode, budget, match", [
    (torch.randn(6, 32).to(DEVICE), "dense", 64, "float16"),
    (torch.randn(2, 32).half().to(DEVICE), "dense", 64, r"\[6, 32\]"),
    (torch.randn(6, 32).half().to(DEVICE), "sparse", 64, "mode"),
    (torch.randn(6, 32).half().to(DEVICE), "topk", 0, "budget"),
])
def test_bad_queries_are_refused(tmp_path, q, mode, budget, match):
    store = make_store(tmp_path)
    seq, _, _ = filled(store, 100, seed=5)
    with pytest.raises(ValueError, match=match):
        store.attend(seq, 0, q, mode=mode, budget=budget)
    assert store.stats()["attend"]["calls"] == 0
