"""The fused per-token kernels (engine_adapter/fused_ops.py) against their torch references on irregular
shapes (under TRITON_INTERPRET=1 on the CPU), and the model's kernel path against its torch path: eager,
and through the decode loop that defers each residual add into the next norm. Tests marked `cuda` repeat
the comparisons on the GPU and check the captured decode against the eager torch path."""

from __future__ import annotations

import pytest
import torch

from engine_adapter.decoder import Decoder
from engine_adapter.fused_ops import (
    add_rmsnorm, add_rmsnorm_ref, rmsnorm, rmsnorm_ref, rope, rope_ref, silu_mul, silu_mul_ref,
)
from engine_adapter.graph_decode import GraphDecoder
from engine_adapter.weights import random_llama
from kvstore import Config, KVStore, ModelSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # kernels: compiled on a GPU, interpreted on CPU
DTYPES = [torch.float32, torch.float16]
ROWS = [(1, 576), (7, 4096), (7, 1000)]  # (T, dim): SmolLM2, Llama-3-8B, not a power of two
HEADS = [(9, 3, 64), (32, 8, 128), (5, 1, 80)]  # (Hq, Hkv, D)
TINY = ModelSpec(num_layers=2, num_q_heads=6, num_kv_heads=2, head_dim=16)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """One ulp of the output: reduction order and exp/rsqrt differ between the kernel and torch."""
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=1e-3)


def _close(dtype: torch.dtype):
    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        torch.testing.assert_close(a, b, **tolerance(dtype))
        return True
    return close


def randn(*shape: int, dtype: torch.dtype, seed: int, device: str = "cpu", scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype=dtype, device=device)


def rope_tables(t: int, head_dim: int, dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    angles = randn(t, head_dim // 2, dtype=torch.float32, seed=5, scale=3.0)
    angles = torch.cat((angles, angles), dim=-1)  # [T, D], half-split like Llama.rope
    return angles.cos().to(dtype=dtype, device=device), angles.sin().to(dtype=dtype, device=device)


def check_rmsnorm(t: int, n: int, dtype: torch.dtype, device: str) -> None:
    x, delta = randn(t, n, dtype=dtype, seed=1, device=device), randn(t, n, dtype=dtype, seed=2, device=device)
    weight = randn(n, dtype=dtype, seed=3, device=device, scale=0.3) + 1
    torch.testing.assert_close(rmsnorm(x, weight, 1e-5), rmsnorm_ref(x, weight, 1e-5), **tolerance(dtype))
    residual, normed = add_rmsnorm(x, delta, weight, 1e-6)
    want_residual, want_normed = add_rmsnorm_ref(x, delta, weight, 1e-6)
    exact = torch.equal if device == "cpu" else _close(dtype)  # a GPU may contract mul+add into one fma
    assert exact(residual, want_residual)
    torch.testing.assert_close(normed, want_normed, **tolerance(dtype))
    stream = x.clone()
    residual, normed_inplace = add_rmsnorm(stream, delta, weight, 1e-6, residual_out=stream)
    assert residual is stream and exact(stream, want_residual) and torch.equal(normed_inplace, normed)


def check_rope(t: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str) -> None:
    q_dim, kv_dim = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(t, q_dim + 2 * kv_dim, dtype=dtype, seed=4, device=device)  # q and k: column slices, as merged
    q = qkv[:, :q_dim].view(t, num_q_heads, head_dim)
    k = qkv[:, q_dim: q_dim + kv_dim].view(t, num_kv_heads, head_dim)
    cos, sin = rope_tables(t, head_dim, dtype, device)
    got, want = rope(q, k, cos, sin), rope_ref(q, k, cos, sin)
    for a, b in zip(got, want):
        assert a.is_contiguous() and a.shape == b.shape
        if device == "cpu":  # torch's rounding after each op; a GPU may contract mul+add into one fma
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, **tolerance(dtype))


def check_silu_mul(t: int, n: int, dtype: torch.dtype, device: str) -> None:
    gate, up = randn(t, 2 * n, dtype=dtype, seed=6, device=device, scale=3.0).chunk(2, dim=-1)  # as merged
    torch.testing.assert_close(silu_mul(gate, up), silu_mul_ref(gate, up), **tolerance(dtype))
    torch.testing.assert_close(silu_mul(gate, up, block=128), silu_mul_ref(gate, up), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,n", ROWS)
def test_add_rmsnorm_matches_reference(t: int, n: int, dtype: torch.dtype) -> None:
    check_rmsnorm(t, n, dtype, DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 7])
@pytest.mark.parametrize("heads", HEADS)
def test_rope_matches_reference_bit_for_bit(heads: tuple[int, int, int], t: int, dtype: torch.dtype) -> None:
    check_rope(t, *heads, dtype, DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,n", [(1, 1536), (7, 1000), (2, 14336)])
def test_silu_mul_matches_reference(t: int, n: int, dtype: torch.dtype) -> None:
    check_silu_mul(t, n, dtype, DEVICE)


def test_bad_inputs_say_what_was_expected() -> None:
    x, w = randn(3, 64, dtype=torch.float16, seed=0), randn(64, dtype=torch.float16, seed=1)
    with pytest.raises(ValueError, match=r"weight: expected contiguous torch.float16 \[64\]"):
        rmsnorm(x, w.float(), 1e-5)
    with pytest.raises(ValueError, match="contiguous last dim"):
        rmsnorm(x.t(), w, 1e-5)
    with pytest.raises(ValueError, match="delta: expected"):
        add_rmsnorm(x, x[:2], w, 1e-5)
    with pytest.raises(ValueError, match="only written when delta"):
        add_rmsnorm(x, None, w, 1e-5, residual_out=x)
    q, k = randn(2, 4, 16, dtype=torch.float16, seed=2), randn(2, 2, 16, dtype=torch.float16, seed=3)
    cos, sin = rope_tables(2, 16, torch.float16)
    with pytest.raises(ValueError, match=r"cos: expected torch.float16 \[2, 16\]"):
        rope(q, k, cos[:1], sin)
    with pytest.raises(ValueError, match="even D"):
        rope(q[..., :15], k[..., :15], cos, sin)
    with pytest.raises(ValueError, match="up: expected"):
        silu_mul(x, x.float())
    with pytest.raises(ValueError, match="power of two"):
        silu_mul(x, x, block=100)


def kernel_and_torch_paths(model, store: KVStore, ids: torch.Tensor, new: int) -> dict[str, torch.Tensor]:
    """Prefill logits, then `new` teacher-forced decode steps of one path (the model's current kernel choice):
    eager (Decoder.decode_step: finish) and through GraphDecoder (finish_deferred; eager off CUDA)."""
    decoder, out = Decoder(model, store, graphs=False), {}
    eager, deferred = store.create_sequence(), store.create_sequence()
    out["prefill"] = decoder.prefill(eager, ids[:-new])
    decoder.prefill(deferred, ids[:-new])
    graph = GraphDecoder(model, store, deferred, mode="dense", budget=4096)
    out["eager"] = torch.stack([decoder.decode_step(eager, int(t)) for t in ids[-new:]])
    out["deferred"] = torch.stack([graph(int(t))[0].clone() for t in ids[-new:]])
    store.check_integrity()
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton kernels on CPU tensors need the interpreter; "
                    "the cuda tests below cover the model on the GPU")
def test_the_model_kernel_path_matches_its_torch_path_on_the_cpu() -> None:
    """The Triton path (interpreted) through prefill, eager decode and the deferred-residual decode loop gives
    the torch path's logits; on the CPU the torch path is what runs by default, bit for bit."""
    model = random_llama(TINY, seed=2, vocab_size=97)
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(3))
    config = Config(model=TINY, block_tokens=16, sink_tokens=16, hot_tokens=1024, warm_tokens=0,
                    gpu_bytes=8 << 20, cpu_bytes=8 << 20, device="cpu")
    with KVStore(config) as store:
        default = kernel_and_torch_paths(model, store, ids, 4)
    with KVStore(config) as store:
        fused = kernel_and_torch_paths(model.use_kernels(True), store, ids, 4)
    with KVStore(config) as store:
        plain = kernel_and_torch_paths(model.use_kernels(False), store, ids, 4)
    model.use_kernels(None)
    for key in plain:
        assert torch.equal(default[key], plain[key]), key
        torch.testing.assert_close(fused[key], plain[key], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(plain["deferred"], plain["eager"], atol=1e-5, rtol=1e-5)


CUDA_SPEC = ModelSpec.preset("llama3-8b", num_layers=2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_match_references_on_cuda(dtype: torch.dtype) -> None:
    for t, n in ROWS:
        check_rmsnorm(t, n, dtype, "cuda")
        check_silu_mul(t, 3 * n + 5, dtype, "cuda")
    for heads in HEADS:
        for t in (1, 7, 300):
            check_rope(t, *heads, dtype, "cuda")


def cuda_decode(fused: bool | None, graphs: bool, forced: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and their logits [NEW, vocab] after a 700-token prefill (teacher-forced by `forced`)."""
    model = random_llama(CUDA_SPEC, seed=0, dtype=torch.float16, device="cuda").use_kernels(fused)
    config = Config(model=CUDA_SPEC, block_tokens=64, sink_tokens=64, hot_tokens=1024, warm_tokens=8192,
                    gpu_bytes=1 << 30, cpu_bytes=1 << 28, device="cuda")
    ids = torch.randint(0, model.args.vocab_size, (700,), generator=torch.Generator().manual_seed(0))
    with KVStore(config) as store:
        decoder = Decoder(model, store, graphs=graphs)
        seq = store.create_sequence()
        logits = decoder.prefill(seq, ids, chunk_tokens=256)
        tokens, all_logits = [int(logits.argmax())], [logits]
        for i in range(40):
            logits = decoder.decode_step(seq, tokens[-1] if forced is None else forced[i], "dense")
            all_logits.append(logits)
            tokens.append(int(logits.argmax()))
        store.check_integrity()
    return tokens, torch.stack(all_logits)


@pytest.mark.cuda
def test_captured_fused_decode_matches_eager_torch_decode_on_cuda() -> None:
    """Kernels + merged projections + deferred residual, captured as one graph per token, against plain torch
    run eagerly: logits within fp16 noise on identical inputs, and the same greedy tokens but for near-ties."""
    torch_tokens, torch_logits = cuda_decode(False, graphs=False)
    eager_tokens, eager_logits = cuda_decode(None, graphs=False, forced=torch_tokens)
    graph_tokens, graph_logits = cuda_decode(None, graphs=True, forced=torch_tokens)
    scale = torch_logits.abs().max().item()
    torch.testing.assert_close(eager_logits, torch_logits, atol=2e-2 * scale, rtol=0)
    torch.testing.assert_close(graph_logits, eager_logits, atol=2e-2 * scale, rtol=0)
    for tokens in (eager_tokens, graph_tokens):
        assert sum(a == b for a, b in zip(tokens, torch_tokens)) / len(tokens) >= 0.95
