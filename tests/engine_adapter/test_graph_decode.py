"""The captured decode path on a GPU (marked `cuda`; bench_longctx/h200_run.sh runs it): Decoder.decode_step
replaying one CUDA graph per token generates what the eager path (store.append + store.attend per layer)
generates on the same prefill, stores the same K/V, and keeps the store consistent across block
boundaries, cooling into int8 and the dense -> topk phase change. Speed lives in bench_longctx."""

from __future__ import annotations

import pytest
import torch

from engine_adapter.decoder import Decoder
from engine_adapter.weights import random_llama
from kvstore import Config, KVStore, ModelSpec
from tiers.errors import IntegrityError

pytestmark = pytest.mark.cuda

SPEC = ModelSpec.preset("llama3-8b", num_layers=4)
PROMPT, NEW = 3000, 150


def run(mode: str, graphs: bool, forced: list[int] | None = None, prompt: int = PROMPT,
        **overrides) -> tuple[list[int], torch.Tensor, torch.Tensor, dict]:
    """Greedy decode after a prefill; with `forced`, the inputs are those tokens (teacher forcing), so two
    runs compare logits on identical inputs even where a near-tie flips one argmax."""
    model = random_llama(SPEC, seed=0, dtype=torch.float16, device="cuda")
    config = Config(**{**dict(model=SPEC, block_tokens=64, sink_tokens=64, hot_tokens=1024, warm_tokens=65536,
                              recent_tokens=256, gpu_bytes=4 << 30, cpu_bytes=1 << 30, device="cuda"), **overrides})
    ids = torch.randint(0, model.args.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0))
    with KVStore(config) as store:
        decoder = Decoder(model, store, graphs=graphs)
        seq = store.create_sequence()
        logits = decoder.prefill(seq, ids, chunk_tokens=1024)
        tokens, all_logits = [int(logits.argmax())], []
        for i in range(NEW):
            logits = decoder.decode_step(seq, tokens[-1] if forced is None else forced[i], mode, budget=1024)
            all_logits.append(logits)
            tokens.append(int(logits.argmax()))
        store.check_integrity()
        k, _ = store.read(seq, 0, prompt, prompt + NEW)
        return tokens, torch.stack(all_logits), k.clone(), store.stats()


@pytest.mark.parametrize("mode", ["dense", "topk"])
def test_captured_decode_generates_what_eager_decode_does(mode):
    eager_tokens, eager_logits, eager_k, _ = run(mode, graphs=False)
    graph_tokens, graph_logits, graph_k, stats = run(mode, graphs=True, forced=eager_tokens)
    torch.testing.assert_close(graph_logits, eager_logits, atol=2e-2, rtol=2e-2)
    agree = sum(a == b for a, b in zip(graph_tokens[1:], eager_tokens[1:])) / NEW
    assert agree >= 0.97  # random weights: near-ties in the logits may flip an argmax, nothing more
    assert torch.equal(graph_k, eager_k)  # every generated token's K stored, the same bytes
    assert stats["tiers"]["warm"]["blocks"] > 0 and stats["attend"]["calls"] == SPEC.num_layers * NEW


def test_captured_dense_decode_over_a_long_mixed_table_equals_eager_decode():
    """A 20K-token prompt (8 kv heads: past the one-tile walk, so the kernel walks the table partitioned by pool,
    a partition the step keeps between tokens and makes again when a block cools or opens): the captured logits
    and stored K equal the eager path's, which partitions in every call."""
    eager_tokens, eager_logits, eager_k, _ = run("dense", graphs=False, prompt=20_000)
    graph_tokens, graph_logits, graph_k, stats = run("dense", graphs=True, forced=eager_tokens, prompt=20_000)
    torch.testing.assert_close(graph_logits, eager_logits, atol=2e-2, rtol=2e-2)
    assert torch.equal(graph_k, eager_k)
    assert stats["tiers"]["warm"]["blocks"] > 0


@pytest.mark.parametrize("prompt, warm_tokens", [
    (PROMPT, 65536),  # captured throughout, topk from the start
    (900, 65536),  # starts dense (the budget covers the context), turns topk at 1024 tokens
    (2048, 1024),  # blocks cool out of the warm window into (fp16) cpu mid-run: the step stages them
])
def test_greedy_run_ahead_equals_the_per_token_captured_loop(prompt, warm_tokens):
    """continue_greedy with no eos_id queues token t + 1 before token t's id reaches the host; it must
    generate, store and record exactly what one synced decode_step per token does (both through the graph
    decoder where it can run), across the dense -> topk change and a fall back to the eager path."""
    model = random_llama(SPEC, seed=0, dtype=torch.float16, device="cuda")
    config = Config(model=SPEC, block_tokens=64, sink_tokens=64, hot_tokens=1024, warm_tokens=warm_tokens,
                    recent_tokens=256, gpu_bytes=4 << 30, cpu_bytes=1 << 30, device="cuda")
    ids = torch.randint(0, model.args.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    runs = []
    for ahead in (True, False):
        with KVStore(config) as store:
            decoder = Decoder(model, store)
            seq = store.create_sequence()
            logits = decoder.prefill(seq, ids, chunk_tokens=1024)
            if ahead:
                out = decoder.continue_greedy(seq, logits, NEW, "topk", 1024)
            else:
                out = [int(logits.argmax())]
                while len(out) < NEW:
                    out.append(int(decoder.decode_step(seq, out[-1], "topk", 1024).argmax()))
            store.check_integrity()
            assert store.token_ids(seq) == ids + out[:-1]
            stats = store.stats()  # a block left the GPU: it is in cpu, or was fetched from there and promoted back
            cooled = stats["tiers"]["cpu"]["blocks"] > 0 or stats["attend"]["cold_blocks_fetched"] > 0
            assert cooled == (warm_tokens < 65536)  # the fallback case did reach the eager path, in both runs
            runs.append((out, store.read(seq, SPEC.num_layers - 1, prompt, prompt + NEW - 1)))
    (out_a, (k_a, v_a)), (out_b, (k_b, v_b)) = runs
    assert out_a == out_b
    assert torch.equal(k_a, k_b) and torch.equal(v_a, v_b)


def test_captured_decode_reads_cpu_blocks_as_the_eager_path_does():
    """Most of the context in an int8 cpu tier: the captured step stages the selected blocks' head slices itself
    (verified on the GPU) and generates what the eager path (store.attend running the same step's code, which
    stages the same slices) generates."""
    cold = dict(warm_tokens=512, cpu_dtype="int8")
    eager_tokens, eager_logits, eager_k, eager_stats = run("topk", graphs=False, **cold)
    graph_tokens, graph_logits, graph_k, stats = run("topk", graphs=True, forced=eager_tokens, **cold)
    assert stats["attend"]["cold_slices_staged"] > 0 and stats["attend"]["cold_blocks_fetched"] == 0
    assert eager_stats["attend"]["cold_slices_staged"] > 0 and eager_stats["attend"]["cold_blocks_fetched"] == 0
    torch.testing.assert_close(graph_logits, eager_logits, atol=2e-2, rtol=2e-2)
    agree = sum(a == b for a, b in zip(graph_tokens[1:], eager_tokens[1:])) / NEW
    assert agree >= 0.97
    assert torch.equal(graph_k, eager_k)


def test_captured_sketch_decode_over_cpu_blocks_equals_it_over_gpu_blocks():
    """The captured step over GPU-held (warm int8) blocks against the same step reading most of them from an int8
    cpu tier: the same bytes (the sketch's eager selection differs from the step's two-level one on short contexts,
    so the reference is the step). fp16 cpu tiers: tests/kvstore/decode/test_step.py (their blocks may hold values the
    warm tier never quantized, so only the eager path over the same store is a reference)."""
    warm_tokens, warm_logits, warm_k, _ = run("sketch", graphs=True)
    cold_tokens, cold_logits, cold_k, stats = run("sketch", graphs=True, forced=warm_tokens, warm_tokens=512,
                                                  cpu_dtype="int8")
    assert stats["attend"]["cold_slices_staged"] > 0
    torch.testing.assert_close(cold_logits, warm_logits, atol=1e-3, rtol=1e-3)
    assert torch.equal(cold_k, warm_k)


def test_a_damaged_cpu_block_read_by_the_captured_step_raises():
    model = random_llama(SPEC, seed=0, dtype=torch.float16, device="cuda")
    config = Config(model=SPEC, block_tokens=64, sink_tokens=64, hot_tokens=1024, warm_tokens=512,
                    recent_tokens=256, gpu_bytes=4 << 30, cpu_bytes=1 << 30, cpu_dtype="int8", device="cuda")
    ids = torch.randint(0, model.args.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(0))
    with KVStore(config) as store:
        decoder = Decoder(model, store)
        seq = store.create_sequence()
        logits = decoder.prefill(seq, ids, chunk_tokens=1024)
        token = int(decoder.decode_step(seq, int(logits.argmax()), "topk", budget=1024).argmax())  # captured, intact
        for slab in store.tiers.cpu.slabs:
            slab.data[:, :, :, 0, 0] ^= 1  # every head of every cpu block: whatever the step selects is damaged
        with pytest.raises(IntegrityError, match="checksums"):
            decoder.decode_step(seq, token, "topk", budget=1024)
        assert store.tiers.cpu.integrity_errors > 0


def batch_case(lengths: tuple[int, ...]) -> tuple:
    """(fp16 random Llama on CUDA, a store Config with room for the batch, one random prompt per length)."""
    model = random_llama(SPEC, seed=0, dtype=torch.float16, device="cuda")
    config = Config(model=SPEC, block_tokens=64, sink_tokens=64, hot_tokens=1024, warm_tokens=65536,
                    recent_tokens=256, gpu_bytes=4 << 30, cpu_bytes=1 << 30, device="cuda")
    prompts = [torch.randint(0, model.args.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
               for n in lengths]
    return model, config, prompts


def prefilled(decoder: Decoder, prompts: list[torch.Tensor]) -> list[int]:
    """A sequence per prompt in the decoder's store, each prompt prefilled."""
    seqs = [decoder.store.create_sequence() for _ in prompts]
    for seq, ids in zip(seqs, prompts):
        decoder.prefill(seq, ids, chunk_tokens=1024)
    return seqs


@pytest.mark.parametrize("mode", ["dense", "topk", "sketch"])
def test_a_captured_batch_gives_each_sequence_its_logits_alone(mode):
    """Three sequences of different lengths (one in the dense phase) decoded together by one captured step per
    token, the same tokens forced into each: every row's logits equal that sequence's captured step alone
    within fp16 rounding (the batch's matmuls and kernel splits differ), a sequence leaving half way included.
    A selection can flip a near-tie block on such rounding of q at a token (seen on an H100: top-K, one token of
    40, 0.13 where the others differ by 0.005; the sketch's two-level selection more often): there most tokens
    agree, and the next token agrees again."""
    model, config, prompts = batch_case((500, 3000, 5000))
    forced = torch.randint(0, model.args.vocab_size, (3, 60), generator=torch.Generator().manual_seed(9)).tolist()
    results = []
    for batched in (False, True):
        with KVStore(config) as store:
            decoder = Decoder(model, store)
            seqs = prefilled(decoder, prompts)
            rows = [[] for _ in seqs]
            for t in range(60):
                live = [i for i in range(3) if i != 0 or t < 40]  # the first leaves after 40 tokens
                if batched:
                    logits = decoder.decode_batch([seqs[i] for i in live], [forced[i][t] for i in live], mode, 512)
                else:
                    logits = torch.stack([decoder.decode_step(seqs[i], forced[i][t], mode, 512) for i in live])
                for row, i in enumerate(live):
                    rows[i].append(logits[row])
            store.check_integrity()
            results.append([torch.stack(r) for r in rows])
            if batched and mode == "topk":  # the last tokens ran in the rows of the two sequences left
                assert decoder.graph_decoders.rows.active[512].seqs == tuple(seqs[1:])
            elif batched:  # the last tokens ran as one captured step of the two sequences left
                assert (tuple(seqs[1:]), mode, 512) in decoder.graph_decoders.graphs
    for alone, together in zip(*results):
        close = torch.isclose(together, alone, atol=2e-2, rtol=2e-2).all(-1)  # [tokens]
        agree = {"dense": 1.0, "topk": 0.95, "sketch": 0.9}[mode]
        assert float(close.float().mean()) >= agree, close


def test_captured_rows_take_a_join_and_a_leave_without_a_capture():
    """Three sequences past their dense phase decoded in rows (the scheduler's decode_batch(rows=True)); a fourth
    joins at token 10 and the first leaves at token 30: after the first token's capture no token captures again,
    and every row's logits equal that sequence's captured step alone within fp16 rounding."""
    model, config, prompts = batch_case((2000, 3000, 5000, 2500))
    forced = torch.randint(0, model.args.vocab_size, (4, 40), generator=torch.Generator().manual_seed(9)).tolist()
    live_at = [[i for i in range(4) if (i != 3 or t >= 10) and (i != 0 or t < 30)] for t in range(40)]
    results, captures = [], []
    for batched in (False, True):
        with KVStore(config) as store:
            decoder = Decoder(model, store)
            seqs = prefilled(decoder, prompts)
            rows = [[] for _ in seqs]
            for t, live in enumerate(live_at):
                if batched:
                    logits = decoder.decode_batch([seqs[i] for i in live], [forced[i][t] for i in live], "topk", 512,
                                                  rows=True)
                    captures.append(decoder.graph_decoders.captures)
                else:
                    logits = torch.stack([decoder.decode_step(seqs[i], forced[i][t], "topk", 512) for i in live])
                for row, i in enumerate(live):
                    rows[i].append(logits[row])
            store.check_integrity()
            results.append([torch.stack(r) for r in rows])
            if batched:
                assert decoder.paths["eager"] == 0 and decoder.graph_decoders.rows.active[512].step.num_rows == 4
    assert captures[0] == 1 and captures[-1] == 1, captures
    for alone, together in zip(*results):
        assert torch.isclose(together, alone, atol=2e-2, rtol=2e-2).all()

