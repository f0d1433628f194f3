"""`kvtier bench e2e`: tokens/s of greedy decode for a named geometry with random weights.

The model is engine_adapter.llama's Llama at the geometry's published sizes (hidden
width, vocabulary), random weights initialized on the device. Its KV cache lives in a
KVStore: sinks and the recent window fp16 (hot), everything older int8 (warm) as far as
GPU memory allows, the rest int8 in host memory (cpu). The context is filled either by
the model's own chunked prefill ("prefill") or, at lengths where that prefill would take
far longer than the benchmark, by writing random K/V into every layer ("random": the
decode step reads the same bytes either way, so its speed is measured fairly).

Paths timed, each `steps` greedy tokens:
  static topk / static dense   engine_adapter.static_step: the whole step as one CUDA graph over
                               the fixed context (no append); dense reads every block (the int8 floor)
  eager topk / eager dense     Decoder.decode_step: append + store.attend per layer, launched eagerly
"""

from __future__ import annotations

import time

import torch

from bench_longctx.measure import Deadline, release
from bench_longctx.models import model_store, store_bytes
from bench_longctx.presets import E2EPreset
from engine_adapter.static_step import StaticStep
from bench_longctx.timing import sync
from engine_adapter.llama import Decoder, Llama, LlamaArgs
from kvstore.config import ModelSpec
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


def e2e_store(spec: ModelSpec, p: E2EPreset, device: torch.device) -> KVStore:
    """int8 warm for as much of the context as the device holds; the rest int8 in host memory."""
    sink = 64
    hot = store_bytes(spec, 32, p.hot_tokens, 0, sink)
    per_token = spec.num_layers * BlockLayout.of(spec, 32).int8_bytes / 32
    staging = 4096 // 32 * BlockLayout.of(spec, 32).fp16_bytes
    room = available_bytes(device) - 2 * hot - staging
    warm_tokens = max(0, min(p.context + p.steps * 4, int(room / per_token) - 64)) // 32 * 32
    cold_tokens = p.context - p.hot_tokens - warm_tokens
    cpu_bytes = int(max(0, cold_tokens + 4096) * per_token * 1.1)
    return model_store(spec, device, hot_tokens=p.hot_tokens, warm_tokens=warm_tokens, sink_tokens=sink,
                       recent_tokens=p.recent_tokens, sequences=1, cpu_bytes=max(cpu_bytes, 64 << 20),
                       block_tokens=p.block_tokens)


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


def timed_tokens(run, steps: int, device: torch.device) -> dict:
    sync(device)
    start = time.perf_counter()
    run()
    sync(device)
    seconds = time.perf_counter() - start
    return {"steps": steps, "ms_per_token": 1e3 * seconds / steps, "tokens_per_s": steps / seconds}


def static_path(model: Llama, store: KVStore, seq: int, mode: str, p: E2EPreset) -> dict:
    start = time.perf_counter()
    step = StaticStep(model, store, seq, mode, p.budget)
    setup = time.perf_counter() - start
    step.run(1, 1)  # first replay outside the timing
    out = timed_tokens(lambda: step.run(p.steps, 1), p.steps, store.device)
    del step
    return {**out, "captured": store.device.type == "cuda", "setup_s": setup}


def eager_path(decoder: Decoder, seq: int, mode: str, p: E2EPreset, steps: int) -> dict:
    token = [1]

    def run() -> None:
        for _ in range(steps):
            token[0] = int(decoder.decode_step(seq, token[0], mode, p.budget).argmax())

    decoder.decode_step(seq, token[0], mode, p.budget)  # warm-up (compiles kernels on CUDA)
    return timed_tokens(run, steps, decoder.store.device)


def memory(store: KVStore, model: Llama, seq: int) -> dict:
    tables = [store.table(seq, i) for i in range(store.spec.num_layers)]
    index = sum(t.summaries.numel() * 2 + t.h2o_scores.numel() * 4 + t.slot_map.numel() * 5 for t in tables)
    out = {"tiers": store.stats()["tiers"], "block_index_bytes": index,
           "model_weights_bytes": sum(t.numel() * t.element_size() for t in model.parameters())}
    if store.device.type == "cuda":
        out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(store.device)
    return out


def fill_context(decoder: Decoder, seq: int, p: E2EPreset, progress) -> tuple[str, float]:
    fill = p.fill if p.fill != "auto" else ("prefill" if p.context <= p.max_prefill else "random")
    if fill not in ("prefill", "random"):
        raise ValueError(f"e2e.fill must be 'prefill', 'random' or 'auto', got {p.fill!r}")
    start = time.perf_counter()
    if fill == "prefill":
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, decoder.model.args.vocab_size, (p.context,), generator=g)
        decoder.prefill(seq, ids, chunk_tokens=512)
    else:
        fill_random(decoder.store, seq, p.context, seed=0, progress=progress)
    sync(decoder.store.device)
    return fill, time.perf_counter() - start


def timed_paths(decoder: Decoder, seq: int, p: E2EPreset, deadline: Deadline) -> tuple[dict, list[str]]:
    """Static paths first (they need the context unchanged), then the eager ones, which append."""
    store, paths, notes = decoder.store, {}, []
    resident = all(store.table(seq, i).num_cold == 0 for i in range(store.spec.num_layers))
    for mode in ("topk", "dense"):
        if not resident:
            notes.append(f"static_{mode} skipped: part of the context is in host memory (graphs need it on the GPU)")
        elif deadline.expired():
            notes.append(f"static_{mode} skipped: time budget")
        else:
            paths[f"static_{mode}"] = static_path(decoder.model, store, seq, mode, p)
    for mode in ("topk", "dense"):
        if deadline.expired():
            notes.append(f"eager_{mode} skipped: time budget")
            continue
        paths[f"eager_{mode}"] = eager_path(decoder, seq, mode, p, max(2, p.steps // 4))
    return paths, notes


def run_e2e(p: E2EPreset, device: torch.device, deadline: Deadline, progress) -> dict:
    args = model_args(p.geometry, p.layers)
    model = random_model(args, device, torch.float16 if device.type == "cuda" else torch.float32)
    store = e2e_store(args.spec, p, device)
    try:
        decoder = Decoder(model, store)
        seq = store.create_sequence()
        fill, fill_s = fill_context(decoder, seq, p, progress)
        paths, notes = timed_paths(decoder, seq, p, deadline)
        result = {"geometry": p.geometry, "layers": args.num_layers, "dim": args.dim, "hidden_dim": args.hidden_dim,
                  "vocab_size": args.vocab_size, "dtype": str(model.embed_tokens.weight.dtype).replace("torch.", ""),
                  "context": p.context, "budget": p.budget, "hot_tokens": p.hot_tokens,
                  "recent_tokens": p.recent_tokens, "warm_tokens": store.config.warm_tokens, "fill": fill,
                  "fill_s": fill_s, "paths": paths, "notes": notes, "memory": memory(store, model, seq)}
    finally:
        store.close()
        del model, store
        release(device)
    if fill == "random":
        result["notes"].append("context filled with random K/V written into every layer, not by a prefill: "
                               "decode reads the same bytes either way")
    for kind in ("static", "eager"):
        top, dense = paths.get(f"{kind}_topk"), paths.get(f"{kind}_dense")
        if top and dense:
            result[f"{kind}_topk_speedup_vs_dense"] = top["tokens_per_s"] / dense["tokens_per_s"]
    return result
