"""`kvtier bench decode`: decode-step attention time of one layer against context length.

Per context, measured in the same run: torch SDPA over contiguous fp16 K/V (the baseline),
kvtier dense over an all-fp16 store and over an all-int8 store (store.attend end to end),
and top-K at each budget (store.attend eager; on CUDA also the captured layer step users run
through Decoder.decode_step: append + select + attend + H2O, one graph replay per token, the
host work around it included; and the paged kernel alone). Up to TOKEN_STEP_MAX_CONTEXT tokens the dense
step is also timed as a model runs it: a token of every layer of the geometry in one graph replay (host
work once per token), reported per layer (`kvtier_dense_graphed_per_layer`); so is the top-K step at each
budget over a store of every layer, int8 (warm) but the window, where it fits in GPU memory
(`topk_B_graphed_per_layer`: the store the e2e benchmark decodes from). Every case reports the bytes it
must read (K/V, int8 scales, key summaries for top-K), achieved GB/s, its share of the
copy ceiling measured at the start of the run, and its speedup over SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench_longctx import decode_bench
from bench_longctx.presets import DecodePreset
from bench_longctx.timing import Deadline, rate, release, time_ms
from eviction.select import SeqWindow
from kvstore.config import ModelSpec
from kvstore.blocks.placement import WARM
from kvstore.decode.graphs import GraphedSteps
from kvstore.store import KVStore
from tiers.layout import BlockLayout


def sdpa_ms(spec: ModelSpec, ctx: int, q: torch.Tensor, repeat: int) -> float:
    """The baseline: one query over contiguous fp16 K/V [1, kv_heads, ctx, head_dim], GQA inside SDPA."""
    k = torch.randn((1, spec.num_kv_heads, ctx, spec.head_dim), device=q.device).half()
    v = torch.randn_like(k)
    q4 = q[None, :, None]  # [1, Hq, 1, D]
    ms = time_ms(lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True), q.device, repeat)
    del k, v
    release(q.device)
    return ms


def stored_bytes(store: KVStore, seq: int) -> int:
    """Bytes of K/V (and int8 scales) one dense step over layer 0 reads."""
    t, lay = store.table(seq, 0), store.layout
    warm = int((t.tier_map[: t.num_blocks] == WARM).sum())
    return warm * lay.int8_bytes + (t.num_blocks - warm) * lay.fp16_bytes


def dense_cases(store: KVStore, seq: int, q: torch.Tensor, base: tuple, repeat: int, attend_key: str,
                kernel_key: str) -> dict:
    """Dense store.attend over layer 0's blocks (attend_key) and, on CUDA, the paged kernel alone (kernel_key)."""
    ms = time_ms(lambda: store.attend(seq, 0, q, mode="dense"), store.device, repeat)
    out = {attend_key: rate(ms, stored_bytes(store, seq), *base)}
    if store.device.type == "cuda":
        out[kernel_key] = rate(decode_bench.kernel_only(store, seq, q), stored_bytes(store, seq), *base)
    return out


def topk_cases(store: KVStore, seq: int, q: torch.Tensor, p: DecodePreset, base: tuple, repeat: int) -> dict:
    """top-K at every budget: eager store.attend and, on CUDA, the captured appending layer step."""
    t, lay, dev = store.table(seq, 0), store.layout, store.device
    summary_bytes = t.num_blocks * 2 * store.spec.num_kv_heads * store.spec.head_dim * 2
    out = {}
    for budget in p.budgets:
        k = SeqWindow(num_tokens=t.num_tokens, block_tokens=p.block_tokens, sink_tokens=store.config.sink_tokens,
                      recent_tokens=store.config.recent_tokens).num_selected(budget)
        nbytes = k * lay.fp16_bytes + summary_bytes
        ms = time_ms(lambda b=budget: store.attend(seq, 0, q, mode="topk", budget=b), dev, repeat)
        out[f"topk_{budget}"] = rate(ms, nbytes, *base)
        if dev.type == "cuda":
            steps = appending_layer_step(store, seq, q, "topk", budget)
            out[f"topk_{budget}_graphed"] = rate(time_ms(steps, dev), nbytes, *base)
            del steps
    return out


TOKEN_STEP_MAX_CONTEXT = 32768  # the all-layer store holds ctx tokens in each layer: 4 GiB at 32K for llama3-8b


def all_layers_fit(geometry: str, ctx: int, int8: bool, device: torch.device) -> bool:
    """Whether a store of every layer holding ctx tokens (fp16 or int8 K/V) takes under 3/4 of the free GPU memory."""
    spec = ModelSpec.preset(geometry)
    per_token = 2 * spec.num_kv_heads * spec.head_dim * (1 if int8 else 2) * spec.num_layers
    return ctx * per_token * 1.1 < 0.75 * torch.cuda.mem_get_info(device)[0]


def token_step_per_layer_ms(geometry: str, ctx: int, p: DecodePreset, device: torch.device, mode: str,
                            budget: int, int8: bool = False) -> float:
    """A token of every layer (a store with all the geometry's layers, each holding ctx tokens), appended,
    selected, attended and accounted in one graph replay with the host work between tokens: ms per layer."""
    spec = ModelSpec.preset(geometry)
    store, seq = decode_bench.build_store(ctx, p.block_tokens, int8=int8, needle=None, spec=spec,
                                          device=str(device), recent_tokens=p.recent_tokens)
    try:
        step = store.decode_step(seq, mode=mode, budget=budget)
        g = torch.Generator(device=device).manual_seed(1)
        q = torch.randn((spec.num_q_heads, spec.head_dim), device=device, generator=g).half()
        k = torch.randn((spec.num_kv_heads, spec.head_dim), device=device, generator=g).half()
        steps = GraphedSteps(step, lambda: [step.attend(layer, q, k, k) for layer in range(spec.num_layers)][-1])
        return time_ms(steps, device) / spec.num_layers
    finally:
        store.close()
        del store
        release(device)


def appending_layer_step(store: KVStore, seq: int, q: torch.Tensor, mode: str, budget: int) -> GraphedSteps:
    """Layer 0's decode step as users run it (kvstore/decode/step.py): every call appends a token's K/V, selects,
    attends and accounts, one graph replay plus the host work between tokens."""
    step = store.decode_step(seq, mode=mode, budget=budget)
    k = torch.randn((store.spec.num_kv_heads, store.spec.head_dim), device=q.device).half()  # [H, D]
    return GraphedSteps(step, lambda: step.attend(0, q, k, k))


def measure_context(spec: ModelSpec, ctx: int, p: DecodePreset, device: torch.device, copy_GBps: float,
                    repeat: int) -> dict:
    g = torch.Generator(device=device).manual_seed(ctx)
    q = torch.randn((spec.num_q_heads, spec.head_dim), device=device, generator=g).half()  # [Hq, D]
    layout = BlockLayout.of(spec, p.block_tokens)
    kv_bytes = ctx * 2 * spec.num_kv_heads * spec.head_dim * 2
    sdpa = sdpa_ms(spec, ctx, q, repeat)
    base = (copy_GBps, sdpa)
    modes = {"sdpa": rate(sdpa, kv_bytes, *base)}
    build = dict(spec=spec, device=str(device), recent_tokens=p.recent_tokens)
    store, seq = decode_bench.build_store(ctx, p.block_tokens, int8=False, needle=None, **build)
    try:
        modes.update(dense_cases(store, seq, q, base, repeat, "kvtier_dense", "kernel_fp16"))
        if device.type == "cuda":
            steps = appending_layer_step(store, seq, q, "dense", 0)  # what 8K-32K contexts run: every block
            modes["kvtier_dense_graphed"] = rate(time_ms(steps, device), stored_bytes(store, seq), *base)
            del steps
        modes.update(topk_cases(store, seq, q, p, base, repeat))
        blocks = store.table(seq, 0).num_blocks
    finally:
        store.close()
        del store
        release(device)
    if device.type == "cuda" and ctx <= TOKEN_STEP_MAX_CONTEXT:
        ms = token_step_per_layer_ms(p.geometry, ctx, p, device, "dense", 0)
        modes["kvtier_dense_graphed_per_layer"] = rate(ms, kv_bytes, *base)
    if device.type == "cuda" and all_layers_fit(p.geometry, ctx, True, device):
        for budget in p.budgets:
            ms = token_step_per_layer_ms(p.geometry, ctx, p, device, "topk", budget, int8=True)
            modes[f"topk_{budget}_graphed_per_layer"] = rate(ms, modes[f"topk_{budget}"]["bytes"], *base)
    store, seq = decode_bench.build_store(ctx, p.block_tokens, int8=True, needle=None, **build)
    try:
        modes.update(dense_cases(store, seq, q, base, repeat, "kvtier_int8", "kernel_int8"))
    finally:
        store.close()
        del store
        release(device)
    return {"context": ctx, "kv_bytes_fp16": kv_bytes, "blocks": blocks, "block_bytes_fp16": layout.fp16_bytes,
            "modes": modes}


def run_decode(p: DecodePreset, device: torch.device, copy_GBps: float, repeat: int, deadline: Deadline,
               progress) -> dict:
    """Every context of the preset, smallest first; contexts past the deadline are listed as skipped."""
    spec = ModelSpec.preset(p.geometry, num_layers=1)
    rows, skipped = [], []
    for ctx in progress(sorted(p.contexts), "decode"):
        if deadline.expired():
            skipped.append(ctx)
            continue
        try:
            rows.append(measure_context(spec, ctx, p, device, copy_GBps, repeat))
        except Exception as exc:  # e.g. out of memory at the largest context: keep the others
            rows.append({"context": ctx, "error": f"{type(exc).__name__}: {exc}"})
            release(device)
    return {"geometry": p.geometry, "layers": 1, "block_tokens": p.block_tokens, "budgets": list(p.budgets),
            "sink_tokens": 64, "recent_tokens": p.recent_tokens, "copy_ceiling_GBps": copy_GBps,
            "baseline": "sdpa", "rows": rows, "skipped_contexts_time_budget": skipped}
