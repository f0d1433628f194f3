"""DecodeStep (the capturable all-layer step) against the DecodePath (`eager_path`) on the same tokens: same outputs,
same stored K/V, same summaries and H2O scores, across block boundaries, window crossings
(hot -> warm cooling) and the dense -> topk phase change. Runs eagerly on CPU; on CUDA the
same step is what engines capture (tests/engine_adapter/test_gpu_decode.py replays it)."""

from __future__ import annotations

import pytest
import torch

from kvstore import Config, KVStore, ModelSpec
from kvstore.decode.step import StepNotReady
from tiers.errors import IntegrityError

SPEC = ModelSpec(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=32)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_store(tmp_path, name: str, **overrides) -> KVStore:
    base = dict(model=SPEC, block_tokens=16, sink_tokens=16, hot_tokens=128, warm_tokens=256, recent_tokens=32,
                gpu_bytes=8 << 20, staging_tokens=64, cpu_bytes=1 << 20, ssd_path=str(tmp_path / name),
                device=DEVICE, host_memory_reserve=0)
    return KVStore(Config(**{**base, **overrides}))


def tokens(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per token and layer (q [Hq, D], k [H, D], v [H, D]); keys share a direction so top-K has work."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n * SPEC.num_layers):
        q = torch.randn(4, 32, generator=g)
        k = torch.randn(2, 32, generator=g) + 0.5
        v = torch.randn(2, 32, generator=g)
        out.append(tuple(x.half().to(DEVICE) for x in (q, k, v)))
    return out


def eager_path(store: KVStore, seq: int, layer: int, q: torch.Tensor, mode: str, budget: int = 4096) -> torch.Tensor:
    """The DecodePath's attend (kvstore/decode/eager.py: what store.attend runs where the step cannot serve a token;
    store.table first stores the layer's appended token the eager way)."""
    return store.decode.attend(store.table(seq, layer), q, store.policies.get(mode), budget)


def filled(store: KVStore, length: int, seed: int) -> int:
    """A new sequence of `length` random tokens in every layer."""
    seq = store.create_sequence()
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(length, 2, 32, generator=g).half().to(DEVICE) for _ in range(2))
    for layer in range(SPEC.num_layers):
        store.append(seq, layer, k, v)
    return seq


def twin_stores(tmp_path, length: int, seed: int, **overrides) -> tuple[KVStore, KVStore, int, int]:
    """Two stores holding the same `length` prefill tokens in every layer: (eager, stepped, their sequences)."""
    eager, stepped = make_store(tmp_path, "a", **overrides), make_store(tmp_path, "b", **overrides)
    g = torch.Generator().manual_seed(seed)
    prefill_k, prefill_v = (torch.randn(length, 2, 32, generator=g).half().to(DEVICE) for _ in range(2))
    sa, sb = eager.create_sequence(), stepped.create_sequence()
    for layer in range(SPEC.num_layers):
        eager.append(sa, layer, prefill_k, prefill_v)
        stepped.append(sb, layer, prefill_k, prefill_v)
    return eager, stepped, sa, sb


@pytest.mark.parametrize("mode, budget", [("dense", 4096), ("topk", 128), ("window", 128)])
def test_step_equals_append_plus_attend(tmp_path, mode, budget):
    eager, stepped, sa, sb = twin_stores(tmp_path, 100, seed=0)
    step = stepped.decode_step(sb, mode=mode, budget=budget, capacity_tokens=1024)
    phases, buckets, hot_only = set(), set(), []
    work = tokens(170, seed=1)  # 100 -> 270 tokens: 11 block boundaries, cooling, the topk phase from 128,
    for t in range(170):  # dense tables of 16 blocks, then 20 (the 17th block opens at 257)
        phases.add(step.begin_token())
        *_, bucket, no_warm = step.graph_key()
        buckets.add(bucket)
        hot_only.append(no_warm)
        for layer in range(SPEC.num_layers):
            q, k, v = work[t * SPEC.num_layers + layer]
            eager.append(sa, layer, k[None], v[None])
            want = eager_path(eager, sa, layer, q, mode, budget)
            got = step.attend(layer, q, k, v)
            torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)
        step.end_token()
    assert phases == ({"dense"} if mode == "dense" else {"dense", "topk"})
    assert buckets == ({16, 20} if mode == "dense" else {16, 0})  # topk keys carry no bucket
    # the kernel goes without the warm pool until the first block cools (dense) or the topk phase begins
    first_not = hot_only.index(False)
    assert first_not > 0 and not any(hot_only[first_not:])
    stepped.check_integrity()
    assert stepped.stats()["tiers"]["warm"]["blocks"] > 0  # blocks cooled to int8 under the step
    for layer in range(SPEC.num_layers):
        ta, tb = eager.table(sa, layer), stepped.table(sb, layer)
        assert ta.num_tokens == tb.num_tokens == 270
        ka, va = eager.read(sa, layer)
        kb, vb = stepped.read(sb, layer)
        assert torch.equal(ka, kb) and torch.equal(va, vb)
        n = ta.num_blocks
        assert torch.equal(ta.summaries[:n], tb.summaries[:n])
        # sketch codes of every full block, the last filled by the step's final token (240 = 15 blocks): an eager
        # append or a save right after it must find them on their final grid
        assert torch.equal(ta.sketch[:n], tb.sketch[:n])
        torch.testing.assert_close(ta.h2o_scores[:, :n], tb.h2o_scores[:, :n], atol=1e-4, rtol=1e-3)
    a, b = eager.stats()["attend"], stepped.stats()["attend"]
    assert (a["calls"], a["context_tokens"], a["attended_tokens"]) == (b["calls"], b["context_tokens"],
                                                                       b["attended_tokens"])
    eager.close(), stepped.close()


def test_step_hands_over_to_the_eager_path_when_blocks_go_cold(tmp_path):
    store = make_store(tmp_path, "c", gpu_bytes=200 << 10, warm_tokens=64, hot_tokens=64)
    seq = filled(store, 600, seed=2)
    step = store.decode_step(seq, mode="topk", budget=128)
    assert not step.ready()  # 1 MiB of cpu tier: most blocks beyond the GPU pools spill to ssd, out of its reach
    with pytest.raises(ValueError, match="cold blocks"):
        step.begin_token()
    with pytest.raises(ValueError, match="mode"):
        store.decode_step(seq, mode="no such mode")


def test_a_token_that_cools_a_block_to_cpu_goes_the_eager_way_and_nothing_half_happens(tmp_path):
    store = make_store(tmp_path, "d", warm_tokens=64, hot_tokens=64)
    seq = store.create_sequence()
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(400, 2, 32, generator=g).half().to(DEVICE) for _ in range(2))
    for layer in range(SPEC.num_layers):
        store.append(seq, layer, k[:100], v[:100])
    step = store.decode_step(seq, mode="dense", budget=4096)
    q = torch.randn(4, 32, generator=g).half().to(DEVICE)
    handed_over = None
    for t in range(100, 200):
        try:
            step.begin_token()
        except StepNotReady:
            handed_over = t
            store.check_integrity()  # the cooling happened, the token did not
            assert all(store.table(seq, layer).num_tokens == t for layer in range(SPEC.num_layers))
            break
        for layer in range(SPEC.num_layers):
            step.attend(layer, q, k[t], v[t])
        step.end_token()
    assert handed_over is not None and not step.ready()
    for layer in range(SPEC.num_layers):  # the eager path takes the token from here
        store.append(seq, layer, k[handed_over:handed_over + 1], v[handed_over:handed_over + 1])
        store.attend(seq, layer, q, mode="dense")
    store.check_integrity()
    got_k, _ = store.read(seq, 0, handed_over - 8, handed_over + 1)
    assert torch.equal(got_k[-1], k[handed_over])


CHECKSUMS = "auto" if DEVICE == "cuda" else "cpu"  # block sums where the step verifies cpu slices


def cold_pair(tmp_path, name="c", **overrides):
    """Two stores whose small GPU windows push most of a 600-token prefill into an int8 cpu tier the step can
    serve (block sums on the step's device, staging rows for the whole budget); the same prefill in both."""
    config = {**dict(hot_tokens=64, warm_tokens=64, cpu_bytes=16 << 20, cpu_dtype="int8", cpu_checksums=CHECKSUMS,
                     staging_tokens=128), **overrides}
    eager, stepped = make_store(tmp_path, name + "e", **config), make_store(tmp_path, name + "s", **config)
    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(600, 2, 32, generator=g).half().to(DEVICE) for _ in range(2))
    k[:, :, :4] *= 4  # a few outlier channels, as real keys have: selections differ by head
    seqs = []
    for store in (eager, stepped):
        seqs.append(store.create_sequence())
        for layer in range(SPEC.num_layers):
            store.append(seqs[-1], layer, k, v)
    return eager, stepped, seqs


@pytest.mark.parametrize("mode", ["topk", "sketch"])
def test_step_serves_selected_cpu_blocks_like_gpu_held_ones(tmp_path, mode):
    """Against the same step over a store whose warm window holds every block (the same int8 bytes on the GPU:
    bit-equal, also after the step promoted the blocks it kept reading) and, for topk, the eager path (the
    sketch's eager selection is one 4-bit pass over every block of a short context where the step's is
    two-level, so they may pick different blocks there)."""
    eager, stepped, (sa, sb) = cold_pair(tmp_path)
    _, warm, (_, sw) = cold_pair(tmp_path, "w", warm_tokens=1024)
    cold_before = stepped.table(sb, 0).num_cold
    assert cold_before > 20 and warm.table(sw, 0).num_cold == 0
    step, warm_step = (s.decode_step(q, mode=mode, budget=128) for s, q in ((stepped, sb), (warm, sw)))
    assert step.ready()  # every cold block is in the cpu tier, staged inside the step
    work = tokens(40, seed=6)  # 600 -> 640: block boundaries and blocks cooling into cpu on the way
    for t in range(40):
        step.begin_token(), warm_step.begin_token()
        assert step.stages_cold and not warm_step.stages_cold
        for layer in range(SPEC.num_layers):
            q, k, v = work[t * SPEC.num_layers + layer]
            got = step.attend(layer, q, k, v)
            assert torch.equal(got, warm_step.attend(layer, q, k, v))
            if mode == "topk":
                eager.append(sa, layer, k[None], v[None])
                want = eager_path(eager, sa, layer, q, mode, 128)
                torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)
        step.end_token(), warm_step.end_token()
    step.verify()
    attend = stepped.stats()["attend"]
    assert attend["cold_slices_staged"] > 40
    # blocks read again and again moved up at block boundaries (the same int8 bytes: outputs stayed equal)
    assert attend["promotions"] > 0 and stepped.table(sb, 0).num_cold < cold_before
    stepped.check_integrity()
    for layer in range(SPEC.num_layers):
        assert torch.equal(warm.read(sw, layer)[0], stepped.read(sb, layer)[0])
    eager.close(), stepped.close(), warm.close()


def test_step_serves_fp16_cpu_blocks_like_the_eager_path(tmp_path):
    """An fp16 cpu tier holds some blocks the warm tier never quantized, so the reference is the eager path over the
    same blocks, for the first token (the eager path quantizes an fp16 block it fetched twice into the warm tier,
    after which the two read different values: kvstore/decode/staging.py)."""
    eager, stepped, (sa, sb) = cold_pair(tmp_path, cpu_dtype="float16", cpu_bytes=32 << 20)
    step = stepped.decode_step(sb, mode="topk", budget=128)
    assert step.ready() and stepped.table(sb, 0).num_cold > 20
    step.begin_token()
    for layer, (q, k, v) in enumerate(tokens(1, seed=8)):
        eager.append(sa, layer, k[None], v[None])
        assert torch.equal(step.attend(layer, q, k, v), eager_path(eager, sa, layer, q, "topk", 128))
    step.end_token()
    step.verify()
    assert stepped.stats()["attend"]["cold_slices_staged"] > 0 and eager.stats()["attend"]["cold_blocks_fetched"] > 0
    eager.close(), stepped.close()


def test_a_damaged_cpu_slice_read_by_the_step_raises_at_verify(tmp_path):
    _, store, (_, seq) = cold_pair(tmp_path)
    step = store.decode_step(seq, mode="topk", budget=128)
    cpu = store.tiers.cpu
    for slab in cpu.slabs:  # one bit of every head's first key in every cpu block: whatever is selected is damaged
        slab.data[:, 0, :, 0, 0] ^= 1
    q, k, v = tokens(1, seed=7)[0]
    step.begin_token()
    for layer in range(SPEC.num_layers):
        step.attend(layer, q, k, v)
    step.end_token()
    with pytest.raises(IntegrityError, match="failed their checksums"):
        step.verify()
    assert cpu.integrity_errors > 0
    step.verify()  # reported once


def test_the_step_refuses_cold_blocks_it_cannot_reach(tmp_path):
    _, store, (_, seq) = cold_pair(tmp_path, "a", cpu_bytes=64 << 10)  # most cold blocks spill past cpu to ssd
    assert store.table(seq, 0).num_far > 0
    assert not store.decode_step(seq, mode="topk", budget=128).ready()
    _, store, (_, seq) = cold_pair(tmp_path, "b", staging_tokens=64)  # fewer staging rows than selected blocks
    assert not store.decode_step(seq, mode="topk", budget=128).ready()
    _, store, (_, seq) = cold_pair(tmp_path, "c")
    assert store.decode_step(seq, mode="topk", budget=128).ready()
    assert not store.decode_step(seq, mode="dense").ready()  # a dense step would read every cold block


@pytest.mark.cuda
def test_a_long_all_hot_dense_step_skips_the_partition_walk(tmp_path, monkeypatch):
    """A table long enough for the split walk (80K tokens x 2 kv heads), every block hot, a warm pool present: the
    eager path partitions the table by pool, the step (no block warm) takes the hot-only walk; same outputs."""
    import kvstore.attention.partition as partition_module  # what paged_decode partitions with (not step_dense)

    calls = []
    real = partition_module.partition_table
    monkeypatch.setattr(partition_module, "partition_table", lambda *a, **k: calls.append(1) or real(*a, **k))
    ctx = 80_000
    big = dict(hot_tokens=ctx + 512, warm_tokens=1024, gpu_bytes=96 << 20, cpu_bytes=16 << 20)
    eager, stepped, sa, sb = twin_stores(tmp_path, ctx, seed=3, **big)
    step = stepped.decode_step(sb, mode="dense", budget=4096, capacity_tokens=ctx + 256)
    work = tokens(3, seed=4)
    for t in range(3):
        step.begin_token()
        assert step.graph_key()[-1] is True  # no block is warm: no warm pool for the kernel
        for layer in range(SPEC.num_layers):
            q, k, v = work[t * SPEC.num_layers + layer]
            eager.append(sa, layer, k[None], v[None])
            before = len(calls)
            want = eager_path(eager, sa, layer, q, "dense")
            assert len(calls) == before + 1  # the eager kernel walked the partitioned table
            got = step.attend(layer, q, k, v)
            assert len(calls) == before + 1  # the step did not
            torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)
        step.end_token()
    stepped.check_integrity()
    eager.close(), stepped.close()
