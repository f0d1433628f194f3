"""The e2e benchmark's model and store, shared by the decode, serve and profile benchmarks.

A Llama of a named geometry at its published sizes (hidden width, vocabulary) with random weights initialized
on the device; a KVStore sized to the device (hot fp16 sinks and recent window, the warm format for as much of
the context as the GPU holds after the block tables, the rest in that format in host memory); a context filled
with random K/V written into every layer (what decode reads is the same bytes a prefill would leave); the FLOP
counts and measured matmul rate the prefill is judged against.
"""

from __future__ import annotations

import torch

from bench_longctx.models import model_store, store_bytes
from bench_longctx.presets import E2EPreset
from bench_longctx.timing import time_ms
from engine_adapter.llama import Llama, LlamaArgs
from engine_adapter.prefill import APPEND_TOKENS
from eviction.cascade import CascadeTopK
from kvstore.blocks.table import TableTensors
from kvstore.blocks.tier_stack import staging_bytes
from kvstore.config import ModelSpec
from kvstore.decode.modes import reads_codes
from kvstore.store import KVStore
from tiers.layout import BlockLayout

# geometry -> (dim, hidden_dim, vocab_size, tie_embeddings), from the models' published configs
REAL_SIZES = {
    "llama3-8b": (4096, 14336, 128256, False),
    "llama3-70b": (8192, 28672, 128256, False),
    "qwen2.5-7b": (3584, 18944, 152064, False),
    "smollm2-135m": (576, 1536, 49152, True),
}
CHUNK = 1 << 16
PREFILL_CHUNK = 8192  # queries per SDPA call and MLP pass of the layer-wise prefill on CUDA
GPU_RESERVE = 6 << 30  # activations, CUDA graphs, key summaries growing past the context


def model_args(geometry: str, layers: int = 0) -> LlamaArgs:
    spec = ModelSpec.preset(geometry, **({"num_layers": layers} if layers else {}))
    dim, hidden, vocab, tie = REAL_SIZES[geometry]
    return LlamaArgs(vocab_size=vocab, num_layers=spec.num_layers, num_q_heads=spec.num_q_heads,
                     num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dim=dim, hidden_dim=hidden,
                     tie_embeddings=tie)


def random_model(args: LlamaArgs, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Llama:
    """Like engine_adapter.weights.random_llama, but initialized on the device (8B weights in seconds)."""
    with torch.device("meta"):
        model = Llama(args)
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=g)
    return model.to(dtype).eval()


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] - GPU_RESERVE
    import psutil

    return psutil.virtual_memory().available // 2


def prefill_bytes(args: LlamaArgs, context: int) -> int:
    """Device memory the layer-wise prefill works in besides the store: the hidden states of the prompt,
    one layer's K/V, one chunk's activations and the store's append staging (fp16)."""
    kv_dim = args.num_kv_heads * args.head_dim
    chunk = PREFILL_CHUNK * (4 * args.hidden_dim + 4 * args.num_q_heads * args.head_dim + args.vocab_size)
    return 2 * (context * (args.dim + 2 * kv_dim) + chunk + 6 * APPEND_TOKENS * kv_dim)


def e2e_store(spec: ModelSpec, p: E2EPreset, device: torch.device, reserve: int = 0) -> KVStore:
    """p.warm_format warm for as much of the context as the device holds (less `reserve` bytes and the block
    tables: summaries, maps, H2O scores and sketch codes of every block, GPU-held or not); the rest in that
    format in host memory. Sketch codes (an eighth of the fp16 K/V: 16 GiB at 1M tokens of llama3-8b) only when
    a timed mode reads them."""
    sink = 64
    hot = store_bytes(spec, 32, p.hot_tokens, 0, sink, p.warm_format)
    per_token = spec.num_layers * BlockLayout.of(spec, 32, p.warm_format).warm_bytes / 32
    staging_tokens = max(4096, p.budget)  # a staging row per selected block: the step reads cpu blocks itself
    staging = staging_bytes(BlockLayout.of(spec, p.block_tokens, p.warm_format), staging_tokens)
    blocks = -(-(p.context + p.context // 16) // p.block_tokens)  # a decode step's capacity: 1/16 to spare
    codes = any(reads_codes(m.strip()) for m in p.modes.split(","))
    tables = spec.num_layers * blocks * TableTensors(spec.num_kv_heads, spec.head_dim, p.block_tokens,
                                                     device, sketch_codes=codes).bytes_per_block()
    room = available_bytes(device) - reserve - 2 * hot - staging - tables
    warm_tokens = max(0, min(p.context + p.steps * 8, int(room / per_token) - 64)) // 32 * 32  # 4 paths append
    if p.warm_tokens:
        warm_tokens = min(warm_tokens, p.warm_tokens)
    cold_tokens = p.context - p.hot_tokens - warm_tokens
    cpu_bytes = int(max(0, cold_tokens + 4096) * per_token * 1.1)
    store = model_store(spec, device, hot_tokens=p.hot_tokens, warm_tokens=warm_tokens, sink_tokens=sink,
                        recent_tokens=p.recent_tokens, sequences=1, cpu_bytes=max(cpu_bytes, 64 << 20),
                        block_tokens=p.block_tokens, cpu_dtype=p.warm_format, warm_format=p.warm_format,
                        staging_tokens=staging_tokens, sketch_codes=codes)
    store.policies["cascade"] = CascadeTopK(candidate_factor=p.cascade_candidates)
    return store


def fill_random(store: KVStore, seq: int, context: int, seed: int, progress) -> None:
    spec, dev = store.spec, store.device
    g = torch.Generator(device=dev).manual_seed(seed)
    for layer in progress(range(spec.num_layers), "e2e fill"):
        for start in range(0, context, CHUNK):
            n = min(CHUNK, context - start)
            k = torch.randn((n, spec.num_kv_heads, spec.head_dim), device=dev, generator=g)  # [n, H, D]
            k[..., :8] *= 6  # outlier channels, as real keys have
            v = torch.randn((n, spec.num_kv_heads, spec.head_dim), device=dev, generator=g)
            store.append(seq, layer, k.half(), v.half())


def prefill_flops(args: LlamaArgs, tokens: int) -> float:
    """Matmul FLOPs of a prefill of `tokens` tokens: 2 * layer params * tokens (projections and MLP) plus
    causal attention, 4 * q_heads * head_dim per (query, key) pair per layer (QK^T and PV)."""
    q_dim, kv_dim = args.num_q_heads * args.head_dim, args.num_kv_heads * args.head_dim
    layer_params = args.dim * (2 * q_dim + 2 * kv_dim) + 3 * args.dim * args.hidden_dim
    pairs = tokens * (tokens + 1) / 2
    return args.num_layers * (2.0 * layer_params * tokens + 4.0 * args.num_q_heads * args.head_dim * pairs)


def matmul_flops_per_s(device: torch.device, dtype: torch.dtype) -> float:
    """The device's measured dense matmul rate in `dtype` (the prefill's FLOP-bound ceiling)."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn((n, n), device=device).to(dtype)
    b = torch.randn((n, n), device=device).to(dtype)
    return 2.0 * n ** 3 / (time_ms(lambda: a @ b, device) / 1e3)
