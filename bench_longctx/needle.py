"""`kvtier bench needle` (synthetic part): planted-needle recall per mode and budget.

One layer of a geometry holds `ctx` random keys (8 outlier channels, as real keys have)
and random values, with `needles` needles planted at evenly spread depths. Needle i has
its own query q_i [Hq, D]; its key, per kv head, points along the mean of the group's
q_i heads and is long enough that its logit beats the distractors' log-sum-exp by
`margin` for every head, so exact attention puts most of its mass on it. Its value is a
fresh random vector. A (needle, q head) counts as recalled when the attention output
has cosine > 0.5 with the needle's value: what a model would read out.

Modes: dense (every block, the baseline), topk (Quest bound), window (sinks + recent),
h2o (drop mode: it first sees `h2o_warmup` unrelated queries, as a sequence's earlier
steps, and evicts down to the budget on their attention; then the needle queries come).
"""

from __future__ import annotations

import math

import torch

from bench_longctx.measure import Deadline, release
from bench_longctx.presets import NeedlePreset
from kvstore.config import Config, ModelSpec
from kvstore.decode import AttendStats
from kvstore.store import KVStore

CHUNK = 1 << 16
OUTLIER_CHANNELS, OUTLIER_SCALE = 8, 6.0


def needle_queries(spec: ModelSpec, count: int, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn((count, spec.num_q_heads, spec.head_dim), device=device, generator=g)  # [N, Hq, D] fp32


def needle_keys(spec: ModelSpec, queries: torch.Tensor, ctx: int, margin: float) -> torch.Tensor:
    """fp32 [N, H, D]: per kv head, the direction of the group's mean query, scaled so every head's logit
    reaches log(ctx) + sigma^2 / 2 + margin (the distractors' log-sum-exp for logit variance sigma^2)."""
    d = spec.head_dim
    sigma2 = (d - OUTLIER_CHANNELS + OUTLIER_CHANNELS * OUTLIER_SCALE**2) / d
    target = math.log(ctx) + sigma2 / 2 + margin
    grouped = queries.view(queries.shape[0], spec.num_kv_heads, spec.gqa_group, d)  # [N, H, G, D]
    direction = torch.nn.functional.normalize(grouped.mean(2), dim=-1)  # [N, H, D]
    reach = (grouped * direction[:, :, None]).sum(-1).amin(2).clamp_min(0.5)  # [N, H]: weakest head's q . dir
    return direction * (target * math.sqrt(d) / reach)[..., None]


def needle_positions(ctx: int, count: int, p: NeedlePreset) -> list[int]:
    """Evenly spread depths between the sinks and the recent window, one needle per block."""
    lo = p.sink_tokens + p.block_tokens
    hi = ctx - p.recent_tokens - 2 * p.block_tokens
    if hi <= lo + count * p.block_tokens:
        raise ValueError(f"context {ctx} is too short for {count} needles outside sinks and recent window")
    return [lo + int((i + 0.5) / count * (hi - lo)) for i in range(count)]


def fill(store: KVStore, ctx: int, needles: list[tuple[int, torch.Tensor, torch.Tensor]], seed: int) -> int:
    """A new sequence of ctx random tokens with (position, key [H, D], value [H, D]) needles planted."""
    spec, dev = store.spec, store.device
    g = torch.Generator(device=dev).manual_seed(seed)
    seq = store.create_sequence()
    for start in range(0, ctx, CHUNK):
        n = min(CHUNK, ctx - start)
        k = torch.randn((n, spec.num_kv_heads, spec.head_dim), device=dev, generator=g)  # [n, H, D]
        k[..., :OUTLIER_CHANNELS] *= OUTLIER_SCALE
        v = torch.randn((n, spec.num_kv_heads, spec.head_dim), device=dev, generator=g)
        for pos, key, value in needles:
            if start <= pos < start + n:
                k[pos - start], v[pos - start] = key, value
        store.append(seq, 0, k.half(), v.half())
    return seq


def recalled(out: torch.Tensor, value: torch.Tensor, group: int) -> int:
    """q heads whose output [Hq, D] has cosine > 0.5 with their kv head's needle value [H, D]."""
    want = value.repeat_interleave(group, dim=0).float()  # [Hq, D]
    return int((torch.nn.functional.cosine_similarity(out.float(), want, dim=-1) > 0.5).sum())


def needle_store(spec: ModelSpec, ctx: int, p: NeedlePreset, device: torch.device) -> KVStore:
    """Every block fp16 and GPU-resident, so modes differ only in what they select."""
    token_bytes = 2 * spec.num_kv_heads * spec.head_dim * 2
    hot = ctx + 2 * p.block_tokens
    gpu = (hot + 4 * p.block_tokens + p.sink_tokens) * token_bytes + (4096 + 2 * max(p.budgets)) * token_bytes
    return KVStore(Config(model=spec, block_tokens=p.block_tokens, sink_tokens=p.sink_tokens, hot_tokens=hot,
                          warm_tokens=0, recent_tokens=p.recent_tokens, gpu_bytes=gpu + (8 << 20),
                          staging_tokens=4096 + 2 * max(p.budgets), cpu_bytes=1 << 30, ssd_bytes=1 << 30,
                          device=str(device), host_memory_reserve=0))


def score(store: KVStore, seq: int, queries: torch.Tensor, needles: list, mode: str, budget: int,
          measure_mass: bool) -> dict:
    store.attend_stats = AttendStats()
    hits = 0
    for q, (_, _, value) in zip(queries, needles):
        out = store.attend(seq, 0, q.half(), mode=mode, budget=budget, measure_mass=measure_mass)
        hits += recalled(out, value, store.spec.gqa_group)
    stats = store.attend_stats.as_dict()
    trials = len(needles) * store.spec.num_q_heads
    return {"mode": mode, "budget": budget if mode != "dense" else None, "recall": hits / trials, "found": hits,
            "trials": trials, "mass_captured": stats["mean_mass_captured"], "read_fraction": stats["read_fraction"]}


def run_context(spec: ModelSpec, ctx: int, p: NeedlePreset, device: torch.device) -> list[dict]:
    queries = needle_queries(spec, p.needles + p.h2o_warmup, device, seed=ctx)
    warmup, queries = queries[p.needles:], queries[: p.needles]
    keys = needle_keys(spec, queries, ctx, p.margin)
    values = torch.randn(keys.shape, device=device, generator=torch.Generator(device=device).manual_seed(ctx + 1))
    needles = list(zip(needle_positions(ctx, p.needles, p), keys, values))
    store = needle_store(spec, ctx, p, device)
    try:
        seq = fill(store, ctx, needles, seed=ctx + 2)
        rows = [score(store, seq, queries, needles, "dense", ctx, False)]
        rows += [score(store, seq, queries, needles, mode, b, True) for mode in ("topk", "window") for b in p.budgets]
        store.free(seq)
        for budget in p.budgets:  # h2o drops blocks for good: a fresh copy of the same sequence per budget
            seq = fill(store, ctx, needles, seed=ctx + 2)
            for q in warmup:
                store.attend(seq, 0, q.half(), mode="h2o", budget=budget)
            rows.append(score(store, seq, queries, needles, "h2o", budget, False))
            store.free(seq)
    finally:
        store.close()
        del store
        release(device)
    return [{"context": ctx, **row} for row in rows]


def run_needle(p: NeedlePreset, device: torch.device, deadline: Deadline, progress) -> dict:
    spec = ModelSpec.preset(p.geometry, num_layers=1)
    rows, errors, skipped = [], [], []
    for ctx in progress(sorted(p.contexts), "needle"):
        if deadline.expired():
            skipped.append(ctx)
            continue
        try:
            rows += run_context(spec, ctx, p, device)
        except Exception as exc:
            errors.append({"context": ctx, "error": f"{type(exc).__name__}: {exc}"})
            release(device)
    return {"geometry": p.geometry, "layers": 1, "needles_per_context": p.needles, "margin": p.margin,
            "h2o_warmup_queries": p.h2o_warmup, "sink_tokens": p.sink_tokens, "recent_tokens": p.recent_tokens,
            "block_tokens": p.block_tokens, "rows": rows, "errors": errors, "skipped_contexts_time_budget": skipped}
