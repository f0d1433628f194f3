"""Quest block selection at 1M tokens against the copy ceiling measured in the same run.

    python -m bench_longctx.select_bench --out DIR [--tokens 1048576] [--budget 4096]

Llama-3-8B attention geometry (32 q / 8 kv heads, head_dim 128), one layer, block
sizes 16/32/64. Per block size: the fused `quest_scores` kernel (fp16 and fp8
summaries) and its torch reference, the summary bytes' time at the measured
device-to-device copy ceiling, and the full selection (score + topk + sort, budget
4096 tokens) eager and replayed from a CUDA graph. Medians of
triton.testing.do_bench, which flushes L2 before every run. At block size 32 it
first sweeps the kernel's tuning knobs and uses the fastest everywhere.

Keys are synthetic (Gaussian, 8 outlier channels x8, needles per kv head aligned
with one of its q heads), so the recall columns compare fp16 with fp8 summaries
and block sizes, not Quest with a real model: needle recall = planted needle
blocks selected; oracle recall = overlap with the blocks holding the highest true
q.k (max over the GQA group), both outside the protected sinks/recent window;
fp8_bound_inflation_median = median relative growth of the bound with fp8 summaries.
"""

from __future__ import annotations

import argparse

import torch

from bench_longctx.timing import copy_ceiling_GBps, environment, time_ms, write_json
from eviction.quest_kernel import quest_scores, quest_scores_ref
from eviction.select import SeqWindow, select
from eviction.summaries import summaries_to_fp8, summarize_keys
from eviction.topk import topk_select
from eviction.topk_kernel import topk_sorted

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
CONFIGS = [  # (use_dot, block_n, num_warps)
    (True, 32, 4), (True, 64, 4), (True, 64, 8), (True, 128, 8), (False, 32, 4), (False, 32, 8), (False, 64, 8),
]  # fmt: skip


def synthetic_keys(num_tokens: int, q: torch.Tensor, needles: int, strength: float, seed: int = 0):
    """Keys [T, H, D] fp16 and needle token positions [H, needles] (never in the first/last 1/16)."""
    g = torch.Generator(device=q.device).manual_seed(seed)
    keys = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=q.device, generator=g)  # [T, H, D]
    keys[:, :, :8] *= 8.0  # K's outlier channels
    lo, hi = num_tokens // 16, num_tokens - num_tokens // 16
    tokens = torch.randint(lo, hi, (NUM_KV_HEADS, needles), device=q.device, generator=g)  # [H, n]
    group = NUM_Q_HEADS // NUM_KV_HEADS
    key_norm = keys[:4096].norm(dim=-1).mean()
    for head in range(NUM_KV_HEADS):
        q_head = q[head * group + torch.arange(needles, device=q.device) % group].float()  # [n, D]
        keys[tokens[head], head] = strength * key_norm * q_head / q_head.norm(dim=-1, keepdim=True)
    return keys.half(), tokens


def oracle_block_logits(q: torch.Tensor, keys: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """float32 [H, N]: per kv head and block, the largest true q.k over its tokens and group."""
    qg = q.float().view(NUM_KV_HEADS, -1, HEAD_DIM)  # [H, G, D]
    out = []
    for head in range(NUM_KV_HEADS):
        best = (qg[head] @ keys[:, head].float().T).amax(0)  # [T]
        padded = best.new_full((-(-best.shape[0] // block_tokens) * block_tokens,), float("-inf"))
        padded[: best.shape[0]] = best
        out.append(padded.view(-1, block_tokens).amax(1))  # [N]
    return torch.stack(out)


def recall(chosen: torch.Tensor, reference: torch.Tensor, protected: torch.Tensor) -> float:
    """Mean over heads of |chosen & reference| / |reference|, both outside the protected blocks."""
    hits, total = 0, 0
    keep = set((~protected).nonzero().flatten().tolist())
    for row, ref in zip(chosen.tolist(), reference.tolist()):
        ref_set = set(ref) & keep
        hits += len(set(row) & ref_set)
        total += len(ref_set)
    return hits / max(total, 1)


def sweep(q: torch.Tensor, summaries: torch.Tensor) -> list[dict]:
    rows = []
    for use_dot, block_n, num_warps in CONFIGS:
        kw = dict(use_dot=use_dot, block_n=block_n, num_warps=num_warps)
        rows.append({**kw, "us": 1e3 * time_ms(lambda: quest_scores(q, summaries, **kw), q.device)})
    return rows


def graph_us(fn) -> float:
    """Median of replaying fn captured in a CUDA graph (fn is warmed up first, so Triton has compiled)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return 1e3 * time_ms(graph.replay, "cuda")


def bench_block_size(args, block_tokens: int, q, keys, needle_tokens, knobs: dict, ceiling: float) -> dict:
    window = SeqWindow(num_tokens=keys.shape[0], block_tokens=block_tokens, sink_tokens=args.sink,
                       recent_tokens=args.recent)
    fp16 = summarize_keys(keys, block_tokens)  # [N, 2, H, D]
    fp8 = summaries_to_fp8(fp16)
    row = {"block_tokens": block_tokens, "num_blocks": fp16.shape[0], "summary_MiB": fp16.numel() * 2 / 2**20}
    row["ceiling_us"] = fp16.numel() * 2 / ceiling / 1e3
    row["kernel_us"] = 1e3 * time_ms(lambda: quest_scores(q, fp16, **knobs), q.device)
    row["kernel_GBps"] = fp16.numel() * 2 / row["kernel_us"] / 1e3
    row["kernel_fp8_us"] = 1e3 * time_ms(lambda: quest_scores(q, fp8, **knobs), q.device)
    row["ref_us"] = 1e3 * time_ms(lambda: quest_scores_ref(q, fp16), q.device)
    for name, s in (("fp16", fp16), ("fp8", fp8)):
        run = lambda s=s: topk_select(q, s, window, budget_tokens=args.budget)  # noqa: E731
        row[f"select_{name}_us"] = 1e3 * time_ms(run, q.device)
        row[f"select_{name}_graph_us"] = graph_us(run)
    ref = lambda: topk_select(q, fp16, window, budget_tokens=args.budget, use_kernel=False)  # noqa: E731
    row["select_ref_us"] = 1e3 * time_ms(ref, q.device)
    looser = quest_scores_ref(q, fp8) - quest_scores_ref(q, fp16)  # >= 0 up to rounding: fp8 boxes are wider
    row["fp8_bound_inflation_median"] = float((looser / quest_scores_ref(q, fp16).abs().clamp_min(1e-6)).median())
    protected = window.protected_mask(q.device)
    oracle = select(oracle_block_logits(q, keys, block_tokens), window, args.budget)
    needles = needle_tokens // block_tokens  # [H, n]
    for name, s in (("fp16", fp16), ("fp8", fp8)):
        chosen = topk_select(q, s, window, budget_tokens=args.budget)
        row[f"needle_recall_{name}"] = recall(chosen, needles, protected)
        row[f"oracle_recall_{name}"] = recall(chosen, oracle, protected)
    return row


def bench_topk(device: torch.device, ks: tuple[int, ...] = (64, 256)) -> list[dict]:
    """topk_sorted (one program per row below 2 chunks, two stages above) against torch.topk + sort,
    [kv_heads, n] float32 scores: 1M tokens at 64/32/16-token blocks (+1/16 capacity) and shorter."""
    rows = []
    for n in (2048, 4096, 17408, 34816, 69632):
        scores = torch.randn(NUM_KV_HEADS, n, device=device)
        for k in ks:
            torch_us = 1e3 * time_ms(lambda: torch.sort(torch.topk(scores, k, dim=1, sorted=False).indices, 1),
                                     device)
            rows.append({"n": n, "k": k, "kernel_us": 1e3 * time_ms(lambda: topk_sorted(scores, k), device),
                         "torch_us": torch_us})
    return rows


def print_table(rows: list[dict]) -> None:
    cols = [("block_tokens", "B", "{:d}"), ("summary_MiB", "MiB", "{:.0f}"), ("ceiling_us", "ceil us", "{:.1f}"),
            ("kernel_us", "kern us", "{:.1f}"), ("kernel_GBps", "GB/s", "{:.0f}"),
            ("kernel_fp8_us", "fp8 us", "{:.1f}"), ("fp8_bound_inflation_median", "fp8 infl", "{:.3f}"),
            ("ref_us", "ref us", "{:.0f}"), ("select_fp16_us", "sel us", "{:.1f}"),
            ("select_fp16_graph_us", "graph us", "{:.1f}"), ("select_fp8_graph_us", "fp8 graph", "{:.1f}"),
            ("needle_recall_fp16", "needle16", "{:.3f}"), ("needle_recall_fp8", "needle8", "{:.3f}"),
            ("oracle_recall_fp16", "oracle16", "{:.3f}"), ("oracle_recall_fp8", "oracle8", "{:.3f}")]  # fmt: skip
    print(" ".join(f"{title:>9}" for _, title, _ in cols))
    for row in rows:
        print(" ".join(f"{fmt.format(row[key]):>9}" for key, _, fmt in cols))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for select_bench.json")
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--budget", type=int, default=4096, help="tokens attended per kv head, protected included")
    parser.add_argument("--sink", type=int, default=64)
    parser.add_argument("--recent", type=int, default=1024)
    parser.add_argument("--needles", type=int, default=16, help="planted needle keys per kv head")
    parser.add_argument("--strength", type=float, default=1.0, help="needle norm / mean key norm")
    parser.add_argument("--block-tokens", type=int, nargs="+", default=[16, 32, 64])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("select_bench needs a CUDA device (Triton's interpreter is not a benchmark)")
    device = torch.device("cuda")
    torch.manual_seed(0)
    q = torch.randn(NUM_Q_HEADS, HEAD_DIM, device=device).half()  # [32, 128]
    keys, needle_tokens = synthetic_keys(args.tokens, q, args.needles, args.strength)
    ceiling = copy_ceiling_GBps(device)
    tuning = sweep(q, summarize_keys(keys, 32))
    best = min(tuning, key=lambda r: r["us"])
    knobs = {k: best[k] for k in ("use_dot", "block_n", "num_warps")}
    rows = [bench_block_size(args, b, q, keys, needle_tokens, knobs, ceiling) for b in args.block_tokens]
    topk_rows = bench_topk(device)
    result = {"environment": environment(device), "args": vars(args), "copy_ceiling_GBps": ceiling,
              "geometry": {"num_q_heads": NUM_Q_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM},
              "tuning_block_tokens_32": tuning, "kernel_knobs": knobs, "rows": rows,
              "topk": topk_rows}  # fmt: skip
    write_json(args.out, "select_bench.json", result)
    print(f"copy ceiling {ceiling:.0f} GB/s (read+write); kernel knobs {knobs}")
    print_table(rows)
    for r in topk_rows:
        print(f"topk n={r['n']:6d} k={r['k']:4d}: kernel {r['kernel_us']:6.1f} us, torch.topk+sort {r['torch_us']:6.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
