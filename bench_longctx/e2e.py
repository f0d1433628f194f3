"""`kvtier bench e2e`: tokens/s of greedy decode for a named geometry with random weights.

The model is engine_adapter.llama's Llama at the geometry's published sizes (hidden
width, vocabulary), random weights initialized on the device. Its KV cache lives in a
KVStore: sinks and the recent window fp16 (hot), everything older in e2e.warm_format (int8,
fp8 or int4: warm) as far as GPU memory allows, the rest in that format in host memory (cpu).
The context is filled either by the model's own layer-wise prefill ("prefill": tokens/s reported
beside the FLOP-bound estimate, the prefill's matmul FLOPs over the device's measured matmul rate)
or, at lengths where that prefill would take far longer than the benchmark, by writing random K/V
into every layer (bench_longctx/e2e_setup.py; "random": the decode step reads the same bytes
either way, so its speed is measured fairly).

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

from bench_longctx.presets import E2EPreset
from bench_longctx.e2e_setup import (PREFILL_CHUNK, e2e_store, fill_random, matmul_flops_per_s, model_args,
                                     prefill_bytes, prefill_flops, random_model)
from bench_longctx.timing import Deadline, release, timed
from engine_adapter.llama import Llama
from engine_adapter.decoder import Decoder
from kvstore.store import KVStore


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
    # h2o drops blocks for good, so it runs last, on both paths, after every other mode
    runs = [(kind, dec, m) for kind, dec in kinds for m in ("topk", "cascade", "sketch", "dense")
            if m in p.modes.split(",") and (kind == "graph" or m not in ("sketch", "cascade"))]  # eager: too slow
    runs += [(kind, dec, "h2o") for kind, dec in kinds if "h2o" in p.modes.split(",")]
    for kind, dec, mode in runs:
        if deadline.expired():
            notes.append(f"{kind}_{mode} skipped: time budget")
            continue
        steps = p.steps if kind == "graph" else max(2, p.steps // 4)
        loops = [(f"{kind}_{mode}", False)] + ([("graph_topk_per_token", True)] if f"{kind}_{mode}" ==
                                               "graph_topk" else [])
        for name, per_token in loops:
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
                  "fill_s": fill_s, "prefill": prefill, "paths": paths, "notes": notes,
                  "memory": memory(store, model, seq)}
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
