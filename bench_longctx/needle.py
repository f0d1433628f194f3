"""`kvtier bench needle` (synthetic part): recall of graded, norm-matched needles per mode and budget.

One layer of a geometry holds `ctx` background keys drawn from SmolLM2-135M's own post-RoPE key
distribution (per kv head the mean and full covariance of one layer, bench_longctx/data/
smollm2_key_cov.pt; a shared mean direction and a few high-variance channels, as real keys
have; tiled onto wider geometries) and random values. `needles` needles are planted at
evenly spread depths, each with its own query q_i [Hq, D] (a GQA group's heads share a
direction, as real groups do). Needle i's key has exactly the norm of the key it replaces and
lies in the plane of the group's query direction and a random orthogonal one, at the angle
that puts its logit `margin_i` above the background's log-sum-exp for the group's mean head;
margins are graded from `margin_high` to `margin_low` so dense weights span ~99% to ~1%: a needle is found by its
direction, never by an extreme coordinate or a long key. Its value is a marker: a unit direction
e_i (orthogonal to the other needles' markers), `VALUE_SCALE` times a background value's norm.

A (needle, q head) is a trial when the needle holds >= `min_weight` of that head's exact
softmax (computed from the planted keys), and it is recalled when the attention output carries
at least half the needle's dense contribution along its marker: out . e_i >= w_i * |v_i| / 2
(a selected needle's weight only grows by renormalization; a missed one contributes nothing).

Modes: dense (every block: the check that trials are recalled), topk (the store's selector, the 4-bit
key sketch), quest (the min/max bound), window (sinks + recent) and h2o (drop mode after `h2o_warmup`
unrelated queries) as controls.
"""

from __future__ import annotations

import math

import torch

from bench_longctx.presets import NeedlePreset
from bench_longctx.real_qk import KEY_STATS, load_key_statistics
from bench_longctx.timing import Deadline, release
from kvstore.config import Config, ModelSpec
from kvstore.store import KVStore
from kvstore.blocks.tier_stack import staging_bytes
from tiers.layout import BlockLayout

CHUNK = 1 << 16
VALUE_SCALE = 8.0  # needle value norm over a background value's norm: its contribution stands out of the noise
Q_SCALES = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0)


def key_distribution(spec: ModelSpec, layer: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean [H, D], Cholesky factor [H, D, D]) of SmolLM2 keys in `layer`, tiled onto spec: kv head h takes
    SmolLM2 head h % 3, and a head_dim of 64 * r holds r independent copies of the 64 channels."""
    stats = load_key_statistics(KEY_STATS)
    mean, cov = stats["mean"][layer].float(), stats["cov"][layer].float()  # [3, 64], [3, 64, 64]
    heads = [h % mean.shape[0] for h in range(spec.num_kv_heads)]
    reps = -(-spec.head_dim // mean.shape[1])
    mean = mean[heads].repeat(1, reps)[:, : spec.head_dim]
    cov = torch.stack([torch.block_diag(*[cov[h]] * reps)[: spec.head_dim, : spec.head_dim] for h in heads])
    jitter = 1e-4 * torch.eye(spec.head_dim) * cov.diagonal(dim1=1, dim2=2).mean(1)[:, None, None]
    return mean.to(device), torch.linalg.cholesky(cov + jitter).to(device)


def background(n: int, mean: torch.Tensor, chol: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """fp32 [n, H, D] keys ~ N(mean, chol chol^T) per kv head."""
    z = torch.randn((n, *mean.shape), device=mean.device, generator=g)
    return mean + torch.einsum("nhe,hde->nhd", z, chol)


def needle_queries(spec: ModelSpec, count: int, device: torch.device, seed: int) -> torch.Tensor:
    """Unit-norm fp32 [N, Hq, D]: a group's heads share a direction plus their own half-size part."""
    g = torch.Generator(device=device).manual_seed(seed)
    shared = torch.randn((count, spec.num_kv_heads, 1, spec.head_dim), device=device, generator=g)
    own = torch.randn((count, spec.num_kv_heads, spec.gqa_group, spec.head_dim), device=device, generator=g)
    q = torch.nn.functional.normalize(shared + 0.5 * own, dim=-1)
    return q.view(count, spec.num_q_heads, spec.head_dim)


def logits(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [Hq, D], keys [T, H, D] -> fp32 [Hq, T], softmax scale applied."""
    num_kv_heads, d = keys.shape[1], keys.shape[2]
    qg = q.float().view(num_kv_heads, -1, d)
    return torch.einsum("hgd,thd->hgt", qg, keys.float()).flatten(0, 1) / math.sqrt(d)


def query_scale(q: torch.Tensor, keys: torch.Tensor, radius: torch.Tensor) -> float:
    """The query norm (from Q_SCALES) at which a fully aligned norm-matched needle clears the background's
    log-sum-exp by the most, over the needles' mean: q [N, Hq, D] unit, keys [T, H, D], radius [H]."""
    group = q.shape[1] // keys.shape[1]
    best, best_margin = Q_SCALES[0], -math.inf
    for s in Q_SCALES:
        margins = []
        for qi in q:
            lse = torch.logsumexp(s * logits(qi, keys), dim=1)  # [Hq]
            reach = (qi.view(keys.shape[1], group, -1) * _along(qi, keys.shape[1])[:, None]).sum(-1)  # [H, G]
            peak = s * radius.repeat_interleave(group) * reach.flatten() / math.sqrt(keys.shape[2])
            margins.append(float((peak - lse).mean()))
        if sum(margins) / len(margins) > best_margin:
            best, best_margin = s, sum(margins) / len(margins)
    return best


def _along(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[H, D] unit: the direction of each GQA group's mean query."""
    return torch.nn.functional.normalize(q.view(num_kv_heads, -1, q.shape[-1]).mean(1), dim=-1)


def plant(q: torch.Tensor, keys: torch.Tensor, pos: int, margin: float, g: torch.Generator) -> torch.Tensor:
    """[H, D]: per kv head a key with the norm of keys[pos] in the plane of the group's direction u and a
    random v orthogonal to it, angled so the group's mean logit is the background's log-sum-exp + margin
    (or as close as the norm allows)."""
    num_kv_heads, d = keys.shape[1], keys.shape[2]
    u = _along(q, num_kv_heads)  # [H, D]
    v = torch.randn((num_kv_heads, d), device=keys.device, generator=g)
    v = torch.nn.functional.normalize(v - (v * u).sum(-1, keepdim=True) * u, dim=-1)
    radius = keys[pos].float().norm(dim=-1)  # [H]
    qg = q.float().view(num_kv_heads, -1, d)
    a, b = (qg * u[:, None]).sum(-1).mean(1), (qg * v[:, None]).sum(-1).mean(1)  # [H]: group-mean q.u, q.v
    lse = torch.logsumexp(logits(q, keys), dim=1).view(num_kv_heads, -1).mean(1)  # [H]
    want = (lse + margin) * math.sqrt(d) / radius  # a cos(t) + b sin(t) = want
    amp, phase = torch.sqrt(a * a + b * b), torch.atan2(b, a)
    angle = phase + torch.arccos((want / amp).clamp(-1.0, 1.0))
    return radius[:, None] * (torch.cos(angle)[:, None] * u + torch.sin(angle)[:, None] * v)


def needle_positions(ctx: int, count: int, p: NeedlePreset) -> list[int]:
    """Evenly spread depths between the sinks and the recent window, one needle per block."""
    lo = p.sink_tokens + p.block_tokens
    hi = ctx - p.recent_tokens - 2 * p.block_tokens
    if hi <= lo + count * p.block_tokens:
        raise ValueError(f"context {ctx} is too short for {count} needles outside sinks and recent window")
    return [lo + int((i + 0.5) / count * (hi - lo)) for i in range(count)]


def haystack(spec: ModelSpec, ctx: int, p: NeedlePreset, device: torch.device, seed: int) -> dict:
    """Keys fp16 [ctx, H, D] with needles planted, values fp16, the needle queries [N, Hq, D] (scaled),
    markers [N, H, D] unit, positions, margins, each needle's exact dense weight per q head [N, Hq] and
    the norms of the background keys the needles replaced [N, H]."""
    g = torch.Generator(device=device).manual_seed(seed)
    mean, chol = key_distribution(spec, p.key_layer, device)
    keys = torch.cat([background(min(CHUNK, ctx - s), mean, chol, g) for s in range(0, ctx, CHUNK)])
    q = needle_queries(spec, p.needles + p.h2o_warmup, device, seed + 1)
    q = q * query_scale(q[: p.needles], keys, keys.norm(dim=-1).median(0).values)
    positions = needle_positions(ctx, p.needles, p)
    order = torch.randperm(p.needles, generator=torch.Generator().manual_seed(seed)).tolist()
    low, high = p.margin_low, p.margin_high
    margins = [high - (high - low) * i / max(1, p.needles - 1) for i in order]  # graded, shuffled over depths
    replaced = keys[positions].norm(dim=-1)  # [N, H]: the norms the needles must keep
    for i, pos in enumerate(positions):
        keys[pos] = plant(q[i], keys, pos, margins[i], g)
    keys = keys.half()
    values = torch.randn(keys.shape, device=device, generator=g)  # [T, H, D]
    basis = torch.randn((keys.shape[1], keys.shape[2], p.needles), device=device, generator=g)  # [H, D, N]
    markers = torch.linalg.qr(basis).Q.permute(2, 0, 1)  # [N, H, D]: orthonormal per head, no crosstalk
    for i, pos in enumerate(positions):
        values[pos] = markers[i] * VALUE_SCALE * math.sqrt(spec.head_dim)
    weights = torch.stack([torch.softmax(logits(q[i].half(), keys), dim=1)[:, pos] for i, pos in enumerate(positions)])
    return {"keys": keys, "values": values.half(), "queries": q[: p.needles].half(), "warmup": q[p.needles:].half(),
            "markers": markers, "positions": positions, "margins": margins, "weights": weights,
            "replaced_norms": replaced}


def fill(store: KVStore, hay: dict) -> int:
    seq = store.create_sequence()
    for start in range(0, hay["keys"].shape[0], CHUNK):
        store.append(seq, 0, hay["keys"][start:start + CHUNK], hay["values"][start:start + CHUNK])
    return seq


def needle_store(spec: ModelSpec, ctx: int, p: NeedlePreset, device: torch.device) -> KVStore:
    """Every block fp16 and GPU-resident, so modes differ only in what they select."""
    token_bytes = 2 * spec.num_kv_heads * spec.head_dim * 2
    hot = ctx + 2 * p.block_tokens
    staging = 4096 + 2 * max(p.budgets)
    gpu = (hot + 4 * p.block_tokens + p.sink_tokens) * token_bytes + staging_bytes(BlockLayout.of(spec, p.block_tokens), staging)
    return KVStore(Config(model=spec, block_tokens=p.block_tokens, sink_tokens=p.sink_tokens, hot_tokens=hot,
                          warm_tokens=0, recent_tokens=p.recent_tokens, gpu_bytes=gpu + (8 << 20),
                          staging_tokens=staging, cpu_bytes=1 << 30, ssd_bytes=1 << 30,
                          device=str(device), host_memory_reserve=0))


def score(store: KVStore, seq: int, hay: dict, mode: str, budget: int, min_weight: float,
          measure_mass: bool) -> dict:
    before = store.stats()["attend"]
    found = trials = 0
    group = store.spec.gqa_group
    for i, q in enumerate(hay["queries"]):
        out = store.attend(seq, 0, q, mode=mode, budget=budget, measure_mass=measure_mass).float()  # [Hq, D]
        marker = hay["markers"][i].repeat_interleave(group, dim=0)  # [Hq, D]
        weight = hay["weights"][i]  # [Hq]
        contribution = weight * VALUE_SCALE * math.sqrt(store.spec.head_dim)
        counted = weight >= min_weight
        trials += int(counted.sum())
        found += int(((out * marker).sum(-1) >= contribution / 2)[counted].sum())
    after = store.stats()["attend"]
    delta = {k: after[k] - before[k] for k in ("mass_measured", "mass_captured", "attended_tokens", "context_tokens")}
    return {"mode": mode, "budget": budget if mode != "dense" else None, "recall": found / trials if trials else None,
            "found": found, "trials": trials,
            "mass_captured": delta["mass_captured"] / delta["mass_measured"] if delta["mass_measured"] else None,
            "read_fraction": delta["attended_tokens"] / delta["context_tokens"]}


def run_context(spec: ModelSpec, ctx: int, p: NeedlePreset, device: torch.device) -> list[dict]:
    hay = haystack(spec, ctx, p, device, seed=ctx)
    store = needle_store(spec, ctx, p, device)
    try:
        seq = fill(store, hay)
        rows = [score(store, seq, hay, "dense", ctx, p.min_weight, False)]
        rows += [score(store, seq, hay, mode, b, p.min_weight, True) for mode in ("sketch", "topk", "window")
                 for b in p.budgets]
        store.free(seq)
        for budget in p.budgets:  # h2o drops blocks for good: a fresh copy of the same sequence per budget
            seq = fill(store, hay)
            for q in hay["warmup"]:
                store.attend(seq, 0, q, mode="h2o", budget=budget)
            rows.append(score(store, seq, hay, "h2o", budget, p.min_weight, False))
            store.free(seq)
    finally:
        store.close()
        del store
        release(device)
    w = hay["weights"].flatten()
    spread = {"needle_weight_quantiles": [round(float(x), 4) for x in w.float().cpu().quantile(torch.tensor([0, .1, .5, .9, 1.]))],
              "needle_weights_at_least_min": int((w >= p.min_weight).sum()), "needle_head_pairs": w.numel()}
    return [{"context": ctx, **row, **spread} for row in rows]


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
    return {"geometry": p.geometry, "layers": 1, "needles_per_context": p.needles, "margins": [p.margin_high, p.margin_low],
            "min_weight": p.min_weight, "key_statistics": f"SmolLM2-135M layer {p.key_layer} ({KEY_STATS.name})",
            "h2o_warmup_queries": p.h2o_warmup, "sink_tokens": p.sink_tokens, "recent_tokens": p.recent_tokens,
            "block_tokens": p.block_tokens, "rows": rows, "errors": errors, "skipped_contexts_time_budget": skipped}
