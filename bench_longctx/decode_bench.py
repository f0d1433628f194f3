"""Decode-step attention on one H200 layer against torch SDPA, measured in one run.

    python -m bench_longctx.decode_bench --out DIR [--contexts 131072,1048576] [--block-tokens 32,64]

One layer of Llama-3.1-8B's geometry (32 q / 8 kv heads, head_dim 128). Per context:
SDPA (enable_gqa) on contiguous fp16 K/V (the baseline); kvtier's paged kernel over an
all-fp16 and an all-int8 store (kernel alone, and store.attend end to end); a top-K step
with budget 4096 (store.attend eager, and the captured appending step: append + select + attend + H2O);
the captured appending dense step (append + attend every block + H2O: what 8K-32K contexts run);
and a planted needle (keys drawn from real SmolLM2 key statistics, one key aligned with the
query) that top-K must find. Achieved GB/s against the copy ceiling.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from bench_longctx.timing import copy_ceiling_GBps, environment, time_ms, write_json
from kvstore.attention.paged_decode import paged_decode
from eviction.select import SeqWindow
from eviction.topk import topk_select
from kvstore.config import Config, ModelSpec
from kvstore.decode.graphs import GraphedSteps
from kvstore.store import KVStore
from kvstore.blocks.tier_stack import staging_bytes
from tiers.layout import BlockLayout

SPEC = ModelSpec.preset("llama3-8b", num_layers=1)
BUDGET = 4096
CHUNK = 1 << 16


def real_key_stats(spec: ModelSpec = SPEC, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """Per kv head and channel mean and std of post-RoPE keys of SmolLM2-135M (layer 15, 2K tokens of
    prose; bench_longctx/data), tiled from its 3 heads x 64 channels onto this geometry's 8 x 128."""
    path = os.path.join(os.path.dirname(__file__), "data", "smollm2_key_stats.json")
    with open(path) as f:
        stats = json.load(f)
    heads = [h % 3 for h in range(spec.num_kv_heads)]
    reps = -(-spec.head_dim // 64)
    mean, std = (torch.tensor(stats[name])[heads].repeat(1, reps)[:, : spec.head_dim] for name in ("mean", "std"))
    return mean.to(device), std.to(device)  # [H, D] each


APPEND_ROOM = 32768  # tokens the timed appending steps may add (do_bench calls a fast one ~5K times; 4 steps)


def build_store(ctx: int, block_tokens: int, int8: bool, needle: tuple[int, torch.Tensor] | None,
                spec: ModelSpec = SPEC, device: str = "cuda", recent_tokens: int = 1024) -> tuple[KVStore, int]:
    """A store holding ctx random tokens in every layer of `spec` (the same ones), all fp16 (hot) or all int8
    (warm) but the window."""
    token_bytes = 2 * spec.num_kv_heads * spec.head_dim * 2 * spec.num_layers
    hot = 1024 if int8 else ctx + APPEND_ROOM  # the appending step benchmarks add a token per call
    gpu = int((hot + 2 * block_tokens + 64 + APPEND_ROOM + (ctx * 0.56 if int8 else 0)) * token_bytes) + (8 << 20) + \
        staging_bytes(BlockLayout.of(spec, block_tokens), 4096)
    store = KVStore(Config(model=spec, block_tokens=block_tokens, sink_tokens=64, hot_tokens=hot,
                           warm_tokens=ctx if int8 else 0, recent_tokens=recent_tokens, gpu_bytes=gpu,
                           staging_tokens=4096, cpu_bytes=1 << 30, ssd_bytes=1 << 30, device=device, host_memory_reserve=0))
    seq = store.create_sequence()
    g = torch.Generator(device=device).manual_seed(ctx + block_tokens)
    mean, std = real_key_stats(spec, device)
    for start in range(0, ctx, CHUNK):
        n = min(CHUNK, ctx - start)
        k = mean + std * torch.randn((n, spec.num_kv_heads, spec.head_dim), device=device, generator=g)
        v = torch.randn((n, spec.num_kv_heads, spec.head_dim), device=device, generator=g)
        if needle and start <= needle[0] < start + n:
            k[needle[0] - start] = needle[1]
            v[needle[0] - start] = 4.0
        for layer in range(spec.num_layers):
            store.append(seq, layer, k.half(), v.half())
    assert not any(store.table(seq, layer).num_cold for layer in range(spec.num_layers))
    return store, seq


def kernel_only(store: KVStore, seq: int, q: torch.Tensor) -> float:
    """Median ms of the paged kernel alone over every block of the sequence's layer 0 (CUDA only)."""
    t = store.table(seq, 0)
    n, h = t.num_blocks, store.spec.num_kv_heads
    slots = t.slot_map[:n].expand(h, n)[None]
    is_int8 = (t.tier_map[:n] == 1).expand(h, n)[None]
    num = torch.tensor([t.num_tokens], dtype=torch.int32, device=store.device)
    w = store.tiers.warm.pool
    return time_ms(lambda: paged_decode(q[None], store.tiers.hot.pool, w.data, w.k_scale, w.v_scale, slots, is_int8, num),
                   store.device)


def run_context(ctx: int, block_tokens: int, ceiling: float) -> dict:
    kv_bytes = ctx * SPEC.num_kv_heads * SPEC.head_dim * 2 * 2
    q = torch.randn((SPEC.num_q_heads, SPEC.head_dim), device="cuda").half()
    row = {"context": ctx, "block_tokens": block_tokens, "kv_bytes_fp16": kv_bytes}
    k = torch.randn((1, SPEC.num_kv_heads, ctx, SPEC.head_dim), device="cuda").half()
    v = torch.randn_like(k)
    row["sdpa_ms"] = time_ms(lambda: F.scaled_dot_product_attention(q[None, :, None], k, v, enable_gqa=True), q.device)
    del k, v
    needle_pos = ctx * 5 // 7 + 3
    # The needle: per kv head a key along its q group's mean direction, with a typical key's norm.
    mean, std = real_key_stats()
    typical_norm = (mean.pow(2) + std.pow(2)).sum(-1, keepdim=True).sqrt()  # [H, 1]
    direction = q.float().view(SPEC.num_kv_heads, -1, SPEC.head_dim).mean(1)
    needle_key = (direction / direction.norm(dim=-1, keepdim=True) * typical_norm).half()  # [H, D]
    store, seq = build_store(ctx, block_tokens, int8=False, needle=(needle_pos, needle_key))
    row["fp16_kernel_ms"] = kernel_only(store, seq, q)
    row["fp16_attend_dense_ms"] = time_ms(lambda: store.attend(seq, 0, q, mode="dense"), q.device)
    row["topk_attend_eager_ms"] = time_ms(lambda: store.attend(seq, 0, q, mode="topk", budget=BUDGET), q.device)
    new_key = torch.randn((SPEC.num_kv_heads, SPEC.head_dim), device="cuda").half()
    dense_step = store.decode_step(seq, mode="dense", budget=BUDGET)  # appends a token per call, as decoding does
    row["dense_graphed_ms"] = time_ms(GraphedSteps(dense_step, lambda: dense_step.attend(0, q, new_key, new_key)),
                                      q.device)
    step = store.decode_step(seq, mode="topk", budget=BUDGET)
    graphed = GraphedSteps(step, lambda: step.attend(0, q, new_key, new_key))
    row["topk_graphed_ms"] = time_ms(graphed, q.device)
    t = store.table(seq, 0)
    window = SeqWindow(num_tokens=t.num_tokens, block_tokens=block_tokens, sink_tokens=64, recent_tokens=1024)
    chosen = topk_select(q, t.summaries[: t.num_blocks], window, budget_tokens=BUDGET)
    row["needle_found_heads"] = int((chosen == needle_pos // block_tokens).any(dim=1).sum())
    topk_out = graphed().clone()
    dense_out = store.attend(seq, 0, q, mode="dense")  # the same context, the step's last token included
    row["topk_vs_dense_max_abs_err"] = float((dense_out.float() - topk_out.float()).abs().max())
    store.close()
    del store, graphed
    store, seq = build_store(ctx, block_tokens, int8=True, needle=None)
    row["int8_kernel_ms"] = kernel_only(store, seq, q)
    row["int8_attend_dense_ms"] = time_ms(lambda: store.attend(seq, 0, q, mode="dense"), q.device)
    store.close()
    for name in ("fp16_kernel", "int8_kernel", "dense_graphed", "topk_graphed", "topk_attend_eager",
                 "fp16_attend_dense"):
        row[f"{name}_speedup_vs_sdpa"] = row["sdpa_ms"] / row[f"{name}_ms"]
    row["sdpa_GBps"] = kv_bytes / row["sdpa_ms"] / 1e6
    row["fp16_kernel_GBps"] = kv_bytes / row["fp16_kernel_ms"] / 1e6
    row["fp16_kernel_fraction_of_copy_ceiling"] = row["fp16_kernel_GBps"] / ceiling
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--contexts", default="131072,1048576")
    parser.add_argument("--block-tokens", default="32,64")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    ceiling = copy_ceiling_GBps(device)
    rows = [run_context(int(c), int(b), ceiling) for b in args.block_tokens.split(",") for c in args.contexts.split(",")]
    result = {"environment": environment(device), "copy_ceiling_GBps": ceiling, "budget": BUDGET, "rows": rows}
    write_json(args.out, "decode_h200.json", result)
    keys = ["context", "block_tokens", "sdpa_ms", "fp16_kernel_ms", "int8_kernel_ms", "dense_graphed_ms", "topk_graphed_ms",
            "topk_attend_eager_ms", "fp16_kernel_speedup_vs_sdpa", "int8_kernel_speedup_vs_sdpa",
            "dense_graphed_speedup_vs_sdpa", "topk_graphed_speedup_vs_sdpa", "needle_found_heads"]
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(f"{row[k]:.4g}" if isinstance(row[k], float) else str(row[k]) for k in keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
