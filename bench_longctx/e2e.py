"""`kvtier bench e2e`: tokens/s of greedy decode for a named geometry with random weights.

The model is engine_adapter.llama's Llama at the geometry's published sizes (hidden
width, vocabulary), random weights initialized on the device. Its KV cache lives in a
KVStore: sinks and the recent window fp16 (hot), everything older in e2e.warm_format (int8,
fp8 or int4: warm) as far as GPU memory allows, the rest in that format in host memory (cpu).
The context is filled either by the model's own layer-wise prefill ("prefill": tokens/s reported
beside the FLOP-bound estimate, the prefill's matmul FLOPs over the device's measured matmul rate) or, at lengths where that prefill would take
far longer than the benchmark, by writing random K/V into every layer ("random": the
decode step reads the same bytes either way, so its speed is measured fairly).

Paths timed, each `steps` greedy tokens, every one appended to the store (`appends: true`) and
checked afterwards by reading layer 0's K/V of the generated tokens back from the store:
  graph topk / graph dense     Decoder.continue_greedy on CUDA (the `kvtier generate` loop): each token
                               one CUDA graph replay (engine_adapter/graph_decode.py: append, select,
                               attend in every layer), queued before the last token's id reaches the
                               host; dense reads every block (the int8 floor)
  graph topk per token         Decoder.decode_step per token with its id synced to the host each time
  eager topk / eager dense     the same Decoder with graphs off: store.append + store.attend per layer
"""

from __future__ import annotations


import torch

from bench_longctx.models import model_store, store_bytes
from bench_longctx.presets import E2EPreset
from bench_longctx.timing import Deadline, release, time_ms, timed
from engine_adapter.llama import Llama, LlamaArgs
from engine_adapter.decoder import Decoder
from engine_adapter.prefill import APPEND_TOKENS
from eviction.cascade import CascadeTopK
from kvstore.config import ModelSpec
from kvstore.store import KVStore
from kvstore.blocks.table import TableTensors
from kvstore.blocks.tier_stack import staging_bytes
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
    format in host memory."""
    sink = 64
    hot = store_bytes(spec, 32, p.hot_tokens, 0, sink, p.warm_format)
    per_token = spec.num_layers * BlockLayout.of(spec, 32, p.warm_format).warm_bytes / 32
    staging_tokens = max(4096, p.budget)  # a staging row per selected block: the step reads cpu blocks itself
    staging = staging_bytes(BlockLayout.of(spec, p.block_tokens, p.warm_format), staging_tokens)
    blocks = -(-(p.context + p.context // 16) // p.block_tokens)  # a decode step's capacity: 1/16 to spare
    tables = spec.num_layers * blocks * TableTensors(spec.num_kv_heads, spec.head_dim, p.block_tokens,
                                                     device).bytes_per_block()
    room = available_bytes(device) - reserve - 2 * hot - staging - tables
    warm_tokens = max(0, min(p.context + p.steps * 8, int(room / per_token) - 64)) // 32 * 32  # 4 paths append
    if p.warm_tokens:
        warm_tokens = min(warm_tokens, p.warm_tokens)
    cold_tokens = p.context - p.hot_tokens - warm_tokens
    cpu_bytes = int(max(0, cold_tokens + 4096) * per_token * 1.1)
    store = model_store(spec, device, hot_tokens=p.hot_tokens, warm_tokens=warm_tokens, sink_tokens=sink,
                        recent_tokens=p.recent_tokens, sequences=1, cpu_bytes=max(cpu_bytes, 64 << 20),
                        block_tokens=p.block_tokens, cpu_dtype=p.warm_format, warm_format=p.warm_format,
                        staging_tokens=staging_tokens)
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


def tokens_per_s(run, steps: int, device: torch.device) -> dict:
    _, seconds = timed(run, device)
    return {"steps": steps, "ms_per_token": 1e3 * seconds / steps, "tokens_per_s": steps / seconds}


def decode_path(decoder: Decoder, seq: int, mode: str, p: E2EPreset, steps: int, per_token: bool = False) -> dict:
    """`steps` greedy tokens, timed after one warm-up token (which compiles kernels and captures graphs), then
    every generated token's K/V checked. The tokens come from Decoder.continue_greedy, what `kvtier
    generate` runs (no eos: the captured path queues each token before the last one's id reaches the
    host), or with per_token from one Decoder.decode_step per token and its id synced to the host each
    time (what an engine stepping token by token gets)."""
    start, before, calls = decoder.length(seq), cold_counts(decoder.store), attend_calls(decoder.store)
    logits, setup = timed(lambda: decoder.decode_step(seq, 1, mode, p.budget), decoder.store.device)
    tokens = [1]

    def run() -> None:
        if per_token:
            tokens.append(int(logits.argmax()))
            for _ in range(steps):
                tokens.append(int(decoder.decode_step(seq, tokens[-1], mode, p.budget).argmax()))
        else:
            tokens.extend(decoder.continue_greedy(seq, logits, steps + 1, mode, p.budget))

    out = tokens_per_s(run, steps, decoder.store.device)
    after = cold_counts(decoder.store)
    out["cold"] = {k: after[k] - before[k] for k in after}  # over the path's tokens, warm-up included
    out["store_attend"] = attend_calls(decoder.store, since=calls)
    return {**out, "appends": True, "appended_verified": appended_kv_matches(decoder, seq, start, tokens[:-1]),
            "first_token_s": setup, "graphs": bool(decoder.graphs and decoder.store.device.type == "cuda"),
            "loop": "decode_step per token, id synced" if per_token else "continue_greedy"}


def cold_counts(store: KVStore) -> dict:
    """The store's counters of cold reads: head slices a captured step staged, whole blocks the eager path
    fetched, blocks promoted to the warm tier."""
    attend = store.stats()["attend"]
    return {k: attend[k] for k in ("cold_slices_staged", "cold_blocks_fetched", "promotions")}


def attend_calls(store: KVStore, since: dict | None = None) -> dict:
    """store.attend calls the DecodeStep served, and the DecodePath's by reason (eager_step.py); since `since`."""
    a = store.stats()["attend"]
    now = {"step_calls": a["step_calls"], **{f"fallback_{k}": n for k, n in a["fallback_calls"].items()}}
    return now if since is None else {k: n - since.get(k, 0) for k, n in now.items()}


# one code step of each warm format as a fraction of the group's largest |value| (tiers/quant.py): int8's
# absmax / 127, fp8's widest gap between e4m3 neighbours (3 mantissa bits), int4's (max - min) / 15
QUANT_STEP = {"int8": 1 / 127, "fp8": 1 / 8, "int4": 2 / 15}


def appended_kv_matches(decoder: Decoder, seq: int, start: int, token_ids: list[int],
                        cooled_format: str | None = None) -> bool:
    """Layer 0's K/V of each token depend only on the token and its position: recompute them and compare
    with what the store holds at positions start, start + 1, ... (fp16 storage, hot tier: exact; with
    cooled_format, the quantized format of tokens that may have cooled out of the hot window: within two
    of its steps of the largest value)."""
    model, dev = decoder.model, decoder.device
    positions = torch.arange(start, start + len(token_ids), device=dev)
    cos, sin = model.rope(positions, decoder.dtype)
    with torch.no_grad():
        _, k, v = model.layers[0].qkv(model.embed_tokens(torch.tensor(token_ids, device=dev)), cos, sin)
    got_k, got_v = decoder.store.read(seq, 0, start, start + len(token_ids))
    step = QUANT_STEP[cooled_format] if cooled_format else None
    return all(torch.allclose(got.float(), want.half().float(), rtol=1e-2,
                              atol=2 * float(want.abs().max()) * step if step else 1e-2)
               for got, want in ((got_k, k), (got_v, v)))


def memory(store: KVStore, model: Llama, seq: int) -> dict:
    tables = [store.table(seq, i) for i in range(store.spec.num_layers)]
    index = sum(t.summaries.numel() * 2 + t.h2o_scores.numel() * 4 + t.slot_map.numel() * 5 + t.sketch.numel()
                for t in tables)
    out = {"tiers": store.stats()["tiers"], "block_index_bytes": index,
           "model_weights_bytes": sum(t.numel() * t.element_size() for t in model.parameters())}
    if store.device.type == "cuda":
        out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(store.device)
    return out


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


def fill_kind(p: E2EPreset) -> str:
    fill = p.fill if p.fill != "auto" else ("prefill" if p.context <= p.max_prefill else "random")
    if fill not in ("prefill", "random"):
        raise ValueError(f"e2e.fill must be 'prefill', 'random' or 'auto', got {p.fill!r}")
    return fill


def fill_context(decoder: Decoder, seq: int, p: E2EPreset, progress) -> tuple[str, float, dict | None]:
    """(fill, seconds, prefill rate against the FLOP bound or None for a random fill)."""
    fill = fill_kind(p)
    if fill == "random":
        _, seconds = timed(lambda: fill_random(decoder.store, seq, p.context, seed=0, progress=progress),
                           decoder.store.device)
        return fill, seconds, None
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, decoder.model.args.vocab_size, (p.context,), generator=g)
    chunk = PREFILL_CHUNK if decoder.device.type == "cuda" else 512
    _, seconds = timed(lambda: decoder.prefill(seq, ids, chunk_tokens=chunk), decoder.store.device)
    flops, peak = prefill_flops(decoder.model.args, p.context), matmul_flops_per_s(decoder.device, decoder.dtype)
    return fill, seconds, {"tokens": p.context, "chunk_tokens": chunk, "seconds": seconds,
                           "tokens_per_s": p.context / seconds, "flops": flops, "matmul_flops_per_s": peak,
                           "flop_bound_s": flops / peak, "flop_bound_tokens_per_s": p.context * peak / flops,
                           "fraction_of_flop_bound": flops / peak / seconds}


def timed_paths(decoder: Decoder, seq: int, p: E2EPreset, deadline: Deadline) -> tuple[dict, list[str]]:
    """The captured paths (on CUDA), then the eager ones; every path appends what it generates."""
    store, paths, notes = decoder.store, {}, []
    eager = Decoder(decoder.model, store, graphs=False)
    kinds = (("graph", decoder), ("eager", eager)) if store.device.type == "cuda" else (("eager", eager),)
    for kind, dec in kinds:
        modes = [m for m in ("topk", "cascade", "sketch", "dense") if m in p.modes.split(",")
                 and (kind == "graph" or m not in ("sketch", "cascade"))]  # the eager code modes: too slow at 1M
        for mode in modes:
            if deadline.expired():
                notes.append(f"{kind}_{mode} skipped: time budget")
                continue
            steps = p.steps if kind == "graph" else max(2, p.steps // 4)
            runs = [(f"{kind}_{mode}", False)] + ([("graph_topk_per_token", True)] if f"{kind}_{mode}" ==
                                                  "graph_topk" else [])
            for name, per_token in runs:
                try:
                    paths[name] = decode_path(dec, seq, mode, p, steps, per_token=per_token)
                except Exception as e:  # noqa: BLE001 -- recorded; the paths measured so far stand
                    paths[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
                    notes.append(f"{name} failed; later paths not run (the sequence may be part way through a "
                                 "token)")
                    return paths, notes
    if store.device.type != "cuda":
        notes.append("graph paths need CUDA: on CPU Decoder.decode_step is the eager path")
    return paths, notes


def run_e2e(p: E2EPreset, device: torch.device, deadline: Deadline, progress) -> dict:
    args = model_args(p.geometry, p.layers)
    model = random_model(args, device, torch.float16 if device.type == "cuda" else torch.float32)
    store = e2e_store(args.spec, p, device, prefill_bytes(args, p.context) if fill_kind(p) == "prefill" else 0)
    try:
        decoder = Decoder(model, store)
        seq = store.create_sequence()
        fill, fill_s, prefill = fill_context(decoder, seq, p, progress)
        release(device)  # the fill's freed chunks back to the driver: cuBLAS allocates its handle outside torch's cache
        paths, notes = timed_paths(decoder, seq, p, deadline)
        result = {"geometry": p.geometry, "layers": args.num_layers, "dim": args.dim, "hidden_dim": args.hidden_dim,
                  "vocab_size": args.vocab_size, "dtype": str(model.embed_tokens.weight.dtype).replace("torch.", ""),
                  "context": p.context, "budget": p.budget, "hot_tokens": p.hot_tokens,
                  "recent_tokens": p.recent_tokens, "warm_tokens": store.config.warm_tokens,
                  "warm_format": store.config.warm_format, "cpu_dtype": store.config.cpu_dtype, "fill": fill,
                  "fill_s": fill_s, "prefill": prefill, "paths": paths, "notes": notes, "memory": memory(store, model, seq)}
    finally:
        store.close()
        del model, store
        release(device)
    if prefill:
        result["notes"].append(f"prefill {prefill['tokens_per_s']:.0f} tokens/s, FLOP bound "
                               f"{prefill['flop_bound_tokens_per_s']:.0f} tokens/s ({prefill['flops'] / 1e12:.2f} TFLOP "
                               f"at a measured {prefill['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s matmul): "
                               f"{100 * prefill['fraction_of_flop_bound']:.0f}% of the bound")
    if fill == "random":
        result["notes"].append("context filled with random K/V written into every layer, not by a prefill: "
                               "decode reads the same bytes either way")
    for kind in ("graph", "eager"):
        top, dense = paths.get(f"{kind}_topk"), paths.get(f"{kind}_dense")
        if top and dense and "error" not in top and "error" not in dense:
            result[f"{kind}_topk_speedup_vs_dense"] = top["tokens_per_s"] / dense["tokens_per_s"]
    return result
