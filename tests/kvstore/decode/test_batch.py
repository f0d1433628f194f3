"""BatchStep (B sequences' decode token, one attention launch per layer) against each sequence's DecodeStep
alone in a twin store: the same outputs (bit for bit on CPU, where the kernel's reference attends row by row;
within fp16 rounding on CUDA, where the split plan depends on the batch), the same stored
K/V, summaries and H2O scores, for sequences of different lengths and phases, one of them reading cold
blocks from the cpu tier, across block boundaries and window crossings."""

from __future__ import annotations

import pytest
import torch

from kvstore import Config, KVStore, ModelSpec
from kvstore.decode.batch import BatchStep
from kvstore.decode.step import StepNotReady

SPEC = ModelSpec(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=32)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CHECKSUMS = "auto" if DEVICE == "cuda" else "cpu"  # block sums where the step verifies cpu slices
LENGTHS = (110, 300, 700)  # a dense phase (k = 8 blocks: to 128 tokens), topk over GPU blocks, topk with cpu blocks


def make_store(tmp_path, name: str, **overrides) -> KVStore:
    base = dict(model=SPEC, block_tokens=16, sink_tokens=16, hot_tokens=64, warm_tokens=320, recent_tokens=32,
                gpu_bytes=16 << 20, staging_tokens=3 * 128, cpu_bytes=16 << 20, cpu_dtype="int8",
                cpu_checksums=CHECKSUMS, ssd_path=str(tmp_path / name), device=DEVICE, host_memory_reserve=0)
    return KVStore(Config(**{**base, **overrides}))


def filled(tmp_path, name: str, lengths=LENGTHS, **overrides) -> tuple[KVStore, list[int]]:
    store, seqs = make_store(tmp_path, name, **overrides), []
    for i, n in enumerate(lengths):
        g = torch.Generator().manual_seed(10 + i)
        k, v = (torch.randn(n, 2, 32, generator=g).half().to(DEVICE) for _ in range(2))
        k[:, :, :4] *= 4  # outlier channels, as real keys have: selections differ by head
        seqs.append(store.create_sequence())
        for layer in range(SPEC.num_layers):
            store.append(seqs[-1], layer, k, v)
    return store, seqs


def work(num_seqs: int, num_tokens: int, seed: int) -> torch.Tensor:
    """[tokens, layers, seqs, 3 (q, k, v rows), 4, 32]: q uses all 4 rows, k and v the first 2."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, SPEC.num_layers, num_seqs, 3, 4, 32, generator=g).half().to(DEVICE)


@pytest.mark.parametrize("mode, gpu_bytes", [("dense", 16 << 20), ("topk", 16 << 20), ("sketch", 16 << 20),
                                             ("window", 16 << 20), ("h2o", 16 << 20), ("topk", 320 << 10)])
def test_a_batch_equals_each_sequence_alone(tmp_path, mode, gpu_bytes):
    """gpu_bytes 320K: the GPU pools are full, and new tail blocks make room by cooling blocks into cpu (every
    sequence past its dense phase: a dense step serves GPU-held blocks only). Which blocks cool then depends
    on the order tails are placed in (a batch places all at once): a hot block cooled early is int8 in one
    store and fp16 in the other, so outputs agree within int8 rounding there, and bit for bit otherwise."""
    budget = 128
    full = gpu_bytes < 1 << 20
    lengths = (70, 200, 300) if mode == "dense" else (150, 300, 700) if full else LENGTHS
    alone, seqs = filled(tmp_path, "a", lengths, gpu_bytes=gpu_bytes)
    batched, bseqs = filled(tmp_path, "b", lengths, gpu_bytes=gpu_bytes)
    tiers = batched.tiers
    assert full == (tiers.hot.free_blocks() + tiers.warm.free_blocks() < SPEC.num_layers * len(lengths))
    assert (batched.table(bseqs[2], 0).num_cold > 10) == (mode != "dense")
    if mode == "h2o":  # the first token seeds the prefill's all-zero H2O scores through the DecodePath
        seed = work(len(seqs), 1, seed=2)[0]
        for store, ss in ((alone, seqs), (batched, bseqs)):
            for i, s in enumerate(ss):
                for layer in range(SPEC.num_layers):
                    store.append(s, layer, seed[layer, i, 1, :2][None], seed[layer, i, 2, :2][None])
                    store.attend(s, layer, seed[layer, i, 0], mode=mode, budget=budget)
    singles = [alone.decode_step(s, mode=mode, budget=budget) for s in seqs]
    batch = BatchStep([batched.decode_step(s, mode=mode, budget=budget) for s in bseqs])
    # 110 -> 140: the first sequence turns topk at 128; full: boundaries at 160, 304 and 704 in 12 tokens
    tokens = work(len(seqs), 12 if full else 30, seed=1)
    phases = set()
    for t in range(tokens.shape[0]):
        phases.add(batch.begin_token())
        for s in singles:
            s.begin_token()
        for layer in range(SPEC.num_layers):
            x = tokens[t, layer]  # [B, 3, 4, 32]
            got = batch.attend(layer, x[:, 0], x[:, 1, :2], x[:, 2, :2])
            for i, s in enumerate(singles):
                want = s.attend(layer, x[i, 0], x[i, 1, :2], x[i, 2, :2])
                if DEVICE == "cpu" and not full:
                    assert torch.equal(got[i], want), (t, layer, i)
                else:
                    torch.testing.assert_close(got[i], want, atol=2e-2 if full else 2e-3, rtol=2e-3)
        batch.end_token()
        for s in singles:
            s.end_token()
    batch.verify()
    if mode not in ("dense", "h2o") and not full:  # the short sequence changed phase, the others stayed topk
        assert ("dense", "topk", "topk") in phases and ("topk", "topk", "topk") in phases
    # the window reads the sinks and the newest blocks, none of them in the cpu tier; h2o's seeding token (the
    # DecodePath) left its 8 live blocks on the GPU
    assert (batched.stats()["attend"]["cold_slices_staged"] > 0) == (mode not in ("dense", "window", "h2o"))
    for a, b in zip(seqs, bseqs):
        for layer in range(SPEC.num_layers):
            ta, tb = alone.table(a, layer), batched.table(b, layer)
            assert ta.num_tokens == tb.num_tokens
            start = (ta.num_blocks - 1) * 16 if mode == "h2o" else 0  # h2o: the tail block is never dropped
            for x, y in zip(alone.read(a, layer, start), batched.read(b, layer, start)):
                assert torch.equal(x, y) if not full else (x.float() - y.float()).abs().max() < 0.2
            n = ta.num_blocks
            assert torch.equal(ta.summaries[:n], tb.summaries[:n])
            assert ta.block_ids.count(-1) == tb.block_ids.count(-1) == (mode == "h2o") * (n - 8)  # h2o keeps 8
            exact = DEVICE == "cpu" and not full
            torch.testing.assert_close(ta.h2o_scores[:, :n], tb.h2o_scores[:, :n], atol=0 if exact else 2e-2,
                                       rtol=0 if exact else 1e-2)
    batched.check_integrity()
    alone.close(), batched.close()


def test_a_batch_that_promotes_equals_each_sequence_alone_without_promotion(tmp_path):
    """One sequence of two reads cpu blocks; the batch's step promotes those it keeps reading at its block
    boundaries (kvstore/decode/promotion.py), the single steps in the twin store never do: the same outputs,
    bit for bit on CPU, and the same stored K/V."""
    lengths = (300, 700)
    alone, seqs = filled(tmp_path, "a", lengths, promotions_per_boundary=0)
    batched, bseqs = filled(tmp_path, "b", lengths)
    cold_before = batched.table(bseqs[1], 0).num_cold
    assert cold_before > 10 and batched.table(bseqs[0], 0).num_cold == 0
    singles = [alone.decode_step(s, mode="topk", budget=128) for s in seqs]
    batch = BatchStep([batched.decode_step(s, mode="topk", budget=128) for s in bseqs])
    tokens = work(len(seqs), 40, seed=4)  # 700 -> 740: boundaries at 704, 720 and 736
    for t in range(tokens.shape[0]):
        batch.begin_token()
        for s in singles:
            s.begin_token()
        for layer in range(SPEC.num_layers):
            x = tokens[t, layer]
            got = batch.attend(layer, x[:, 0], x[:, 1, :2], x[:, 2, :2])
            for i, s in enumerate(singles):
                want = s.attend(layer, x[i, 0], x[i, 1, :2], x[i, 2, :2])
                if DEVICE == "cpu":
                    assert torch.equal(got[i], want), (t, layer, i)
                else:
                    torch.testing.assert_close(got[i], want, atol=2e-3, rtol=2e-3)
        batch.end_token()
        for s in singles:
            s.end_token()
    batch.verify()
    assert batched.stats()["attend"]["promotions"] > 0 and alone.stats()["attend"]["promotions"] == 0
    assert batched.table(bseqs[1], 0).num_cold < cold_before <= alone.table(seqs[1], 0).num_cold
    for a, b in zip(seqs, bseqs):
        for layer in range(SPEC.num_layers):
            assert all(torch.equal(x, y) for x, y in zip(alone.read(a, layer), batched.read(b, layer)))
    batched.check_integrity(), alone.check_integrity()
    alone.close(), batched.close()


def test_a_batch_needs_staging_rows_for_every_sequences_cold_blocks(tmp_path):
    """Staging rows for only one sequence's selection: the batch refuses (StepNotReady) before anything of
    the token happens, and the sequences are as they were."""
    store, seqs = filled(tmp_path, "s", lengths=(700, 700), staging_tokens=128)
    batch = BatchStep([store.decode_step(s, mode="topk", budget=128) for s in seqs])
    lengths = [store.table(s, 0).num_tokens for s in seqs]
    assert not batch.ready()
    with pytest.raises(StepNotReady):
        batch.begin_token()
    assert [store.table(s, 0).num_tokens for s in seqs] == lengths
    store.check_integrity()
    store.close()


def test_a_batch_refuses_mixed_modes_and_repeated_sequences(tmp_path):
    store, seqs = filled(tmp_path, "m", lengths=(100, 100))
    with pytest.raises(ValueError, match="same mode"):
        BatchStep([store.decode_step(seqs[0], mode="topk"), store.decode_step(seqs[1], mode="dense")])
    with pytest.raises(ValueError, match="twice"):
        BatchStep([store.decode_step(seqs[0]), store.decode_step(seqs[0])])
    with pytest.raises(ValueError, match="at least one"):
        BatchStep([])
    store.close()


def test_a_store_without_sketch_codes_serves_topk_and_dense_and_refuses_sketch(tmp_path):
    """Config.sketch_codes=False: no code tensors (their device memory back), the batch step serves topk and
    dense, mode="sketch" is refused by the step and the eager path alike, and a save opens bit-equal."""
    store, seqs = filled(tmp_path, "n", lengths=(300, 700), sketch_codes=False)
    assert store.table(seqs[0], 0).sketch.shape[-1] == 0
    for mode in ("topk", "dense"):
        batch = BatchStep([store.decode_step(s, mode=mode, budget=128) for s in seqs]) if mode == "topk" else None
        if batch is None:
            continue
        x = work(2, 1, seed=3)[0]
        batch.begin_token()
        for layer in range(SPEC.num_layers):
            assert batch.attend(layer, x[layer, :, 0], x[layer, :, 1, :2], x[layer, :, 2, :2]).isfinite().all()
        batch.end_token()
    q = torch.randn(4, 32, generator=torch.Generator().manual_seed(4)).half().to(DEVICE)
    with pytest.raises(ValueError, match="sketch_codes"):
        store.decode_step(seqs[0], mode="sketch")
    with pytest.raises(ValueError, match="sketch_codes"):
        store.attend(seqs[0], 0, q, mode="sketch", budget=128)
    dense = store.attend(seqs[1], 1, q, mode="dense")
    store.save(seqs[1], "no-codes")
    opened = store.open("no-codes")
    assert torch.equal(store.attend(opened, 1, q, mode="dense"), dense)
    store.check_integrity()
    store.close()


@pytest.mark.parametrize("hot_sequences", [1, 3])
def test_hot_sequences_keeps_every_hot_window_on_the_hot_tier(tmp_path, hot_sequences):
    """Full GPU pools, three sequences crossing block boundaries together: with a hot pool sized for all three
    (Config.hot_sequences) every sink and hot-window block stays fp16; sized for one, new tails make room by
    cooling some of them."""
    store, seqs = filled(tmp_path, "h", (155, 300, 700), gpu_bytes=320 << 10, hot_sequences=hot_sequences)
    batch = BatchStep([store.decode_step(s, mode="topk", budget=128) for s in seqs])
    tokens = work(len(seqs), 6, seed=2)  # boundaries at 160, 304 and 704
    for t in range(tokens.shape[0]):
        batch.begin_token()
        for layer in range(SPEC.num_layers):
            x = tokens[t, layer]
            batch.attend(layer, x[:, 0], x[:, 1, :2], x[:, 2, :2])
        batch.end_token()
    c = store.config
    cooled = 0
    for seq in seqs:
        for layer in range(SPEC.num_layers):
            table = store.table(seq, layer)
            n, tiers = table.num_tokens, table.tier_map[: table.num_blocks].tolist()
            hot = [i for i in range(table.num_blocks) if i * c.block_tokens < c.sink_tokens
                   or (i + 1) * c.block_tokens > n - c.hot_tokens]
            cooled += sum(tiers[i] != 0 for i in hot)
    assert (cooled == 0) == (hot_sequences == 3), cooled
