"""Paged decode attention at 128K and 1M tokens on one GPU, against torch SDPA and the copy ceiling.

    python -m bench_longctx.kernel_bench --out DIR [--quick]

One layer of Llama-3-8B attention (32 q / 8 kv heads, head_dim 128), batch 1, block sizes
32 and 64. Per context and block size: torch SDPA (enable_gqa) over contiguous fp16 K/V, and
paged_decode over
    fp16           every block fp16, only the hot pool (the kernel's pure fp16 build)
    fp16+warm      the same table with a warm pool present (table partitioned per pool: one launch each)
    int8           every block int8, only the warm pool
    int8+hot       the same with a hot pool present (partitioned)
    fp8, int4      every block in that warm format (Config.warm_format), only the warm pool: the fp16
                   blocks quantized by tiers.quant (int4 in groups of 32), read by the Triton walk
    mixed          blocks alternate fp16/int8 (partitioned; int8_bench.py compares the split walks)
    fp16+mass      fp16 with return_block_mass=True (the H2O scores)
The table is a random permutation of the blocks, one row expanded over the kv heads (dense
mode). Times are medians of triton.testing.do_bench, which flushes L2 before every run;
GB/s counts the bytes the kernel must read (K, V, scales; tiers/layout.py). Unless --quick, at 1M
tokens it first sweeps tile and split configs for fp16 and int8 per block size and then uses the
fastest for every case of that pool and block size (fp8 and int4 run the default config). Ends with
a correctness check against paged_decode_ref at 8K tokens (mixed blocks, GQA 4, block mass; and the
fp8 and int4 pools). Needs < 20 GB of GPU memory.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F

from bench_longctx.timing import copy_ceiling_GBps, environment, time_ms, write_json
from kvstore.attention.paged_decode import paged_decode
from kvstore.attention.plan import DecodeGeometry, decode_config
from kvstore.attention.reference import paged_decode_ref
from tiers.layout import BlockLayout
from tiers.quant import quantize

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
CONTEXTS = (131072, 1048576)
BLOCK_SIZES = (32, 64)
TARGETS = {"fp16": 0.92, "int8": 1.7}  # speed relative to SDPA the kernel aims for at 1M tokens
CASES = ("fp16", "fp16+warm", "int8", "int8+hot", "mixed", "fp16+mass", "fp8", "int4")
QUANTIZE_BLOCKS = 4096  # blocks quantized per call: bounds the f32 temporaries at 1M tokens
SWEEP_TOKENS_PER_ITER, SWEEP_WARPS, SWEEP_STAGES, SWEEP_SPLIT_FACTORS = (64, 128), (4, 8), (2, 3), (0.5, 1, 2)


def make_pools(num_tokens: int, block_tokens: int, device: torch.device) -> dict:
    """Full hot and warm pools holding every block, small spare pools, and a permuted dense table."""
    n = num_tokens // block_tokens
    shape = (n, 2, NUM_KV_HEADS, block_tokens, HEAD_DIM)
    hot = torch.randn(shape, dtype=torch.float16, device=device)
    warm = torch.randint(-127, 128, shape, dtype=torch.int8, device=device)
    k_scale = torch.rand((n, NUM_KV_HEADS, HEAD_DIM), device=device) * 0.02 + 0.005
    v_scale = torch.rand((n, NUM_KV_HEADS, block_tokens), device=device) * 0.02 + 0.005
    table = torch.randperm(n, device=device).int()[None, None].expand(1, NUM_KV_HEADS, n)
    alternate = (torch.arange(n, device=device) % 2 == 1)[None, None].expand(1, NUM_KV_HEADS, n)
    return dict(hot=hot, warm=warm, k_scale=k_scale, v_scale=v_scale, table=table, alternate=alternate,
                n=n, block_tokens=block_tokens)


def quantized_pool(pools: dict, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hot pool's blocks in `fmt` (fp8 or int4), quantized by tiers.quant once and kept in `pools`."""
    if fmt not in pools:
        parts = [quantize(pools["hot"][i:i + QUANTIZE_BLOCKS], fmt) for i in range(0, pools["n"], QUANTIZE_BLOCKS)]
        pools[fmt] = tuple(torch.cat(t) for t in zip(*(part.tensors() for part in parts)))
    return pools[fmt]


def case_args(pools: dict, case: str, q: torch.Tensor) -> tuple:
    """paged_decode's positional arguments for one case."""
    p, n = pools, pools["n"]
    all_int8 = torch.ones_like(p["alternate"])
    small_hot, small_warm = p["hot"][:16], (p["warm"][:16], p["k_scale"][:16], p["v_scale"][:16])
    empty_hot, empty_warm = p["hot"][:0], (p["warm"][:0], p["k_scale"][:0], p["v_scale"][:0])
    full_warm = (p["warm"], p["k_scale"], p["v_scale"])
    if case in ("fp8", "int4"):
        hot, warm, flags = empty_hot, quantized_pool(p, case), all_int8
    else:
        hot, warm, flags = {
            "fp16": (p["hot"], empty_warm, ~all_int8), "fp16+warm": (p["hot"], small_warm, ~all_int8),
            "fp16+mass": (p["hot"], empty_warm, ~all_int8), "int8": (empty_hot, full_warm, all_int8),
            "int8+hot": (small_hot, full_warm, all_int8), "mixed": (p["hot"], full_warm, p["alternate"]),
        }[case]
    num_tokens = torch.tensor([n * p["block_tokens"]], dtype=torch.int32, device=q.device)
    return (q, hot, *warm, p["table"], flags, num_tokens)


def bytes_read(case: str, num_tokens: int, block_tokens: int) -> int:
    layout, n = BlockLayout(NUM_KV_HEADS, block_tokens, HEAD_DIM), num_tokens // block_tokens
    fp16, int8 = n * layout.fp16_bytes, n * layout.int8_bytes
    if case in ("fp8", "int4"):
        return n * layout.bytes_for(case)
    return {"int8": int8, "int8+hot": int8, "mixed": (fp16 + int8) // 2}.get(case, fp16)


def pool_kind(case: str) -> str:
    """The pool whose swept config a case runs: fp8 and int4 are not swept (their own key is never in `best`)."""
    return case if case in ("fp8", "int4") else "int8" if case.startswith("int8") else "fp16"


def resolve(config: dict, pools: dict, device: torch.device) -> dict:
    """paged_decode kwargs for a swept config: its split factor scales the auto split count of this geometry."""
    geom = DecodeGeometry(1, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, pools["block_tokens"], pools["n"])
    auto = decode_config(geom, device, blocks_per_iter=config["blocks_per_iter"]).num_splits
    kwargs = {k: v for k, v in config.items() if k != "split_factor"}
    return {**kwargs, "num_splits": max(1, int(auto * config["split_factor"]))}


def sweep(pools: dict, q: torch.Tensor, case: str, deadline: float) -> tuple[dict, list[dict]]:
    """Time paged_decode over a grid of configs until the deadline; returns the fastest config and every row."""
    args = case_args(pools, case, q)
    rows = []
    grid = itertools.product(SWEEP_STAGES, SWEEP_TOKENS_PER_ITER, SWEEP_WARPS, SWEEP_SPLIT_FACTORS)
    for stages, tokens, warps, factor in grid:  # each compile first at 2 stages: the budget may end the sweep
        if time.time() > deadline:
            break
        config = dict(blocks_per_iter=max(1, tokens // pools["block_tokens"]), num_warps=warps, num_stages=stages,
                      split_factor=factor)
        kwargs = resolve(config, pools, q.device)
        ms = time_ms(lambda: paged_decode(*args, **kwargs), q.device)
        rows.append({"case": case, "block_tokens": pools["block_tokens"], **kwargs, "split_factor": factor, "ms": ms})
    if not rows:  # out of time before the first config
        return {}, rows
    best = min(rows, key=lambda r: r["ms"])
    return {k: best[k] for k in ("blocks_per_iter", "num_warps", "num_stages", "split_factor")}, rows


def run_context(num_tokens: int, block_tokens: int, q: torch.Tensor, sdpa_ms: float, ceiling: float,
                best: dict) -> list[dict]:
    """Every paged case at one context and block size, default config and (if swept) the best one."""
    pools = make_pools(num_tokens, block_tokens, q.device)
    rows = []
    for case in CASES:
        args = case_args(pools, case, q)
        configs = {"default": {}}
        if (pool_kind(case), block_tokens) in best:
            configs["best"] = resolve(best[(pool_kind(case), block_tokens)], pools, q.device)
        for label, config in configs.items():
            ms = time_ms(lambda: paged_decode(*args, return_block_mass=case == "fp16+mass", **config), q.device)
            gbps = bytes_read(case, num_tokens, block_tokens) / ms / 1e6
            rows.append({"tokens": num_tokens, "block_tokens": block_tokens, "case": case, "config": label,
                         **config, "ms": ms, "GBps": gbps, "of_ceiling": gbps / ceiling,
                         "speed_vs_sdpa": sdpa_ms / ms})
    del pools
    torch.cuda.empty_cache()
    return rows


def sdpa_ms(num_tokens: int, q: torch.Tensor) -> float:
    k = torch.randn((1, NUM_KV_HEADS, num_tokens, HEAD_DIM), dtype=torch.float16, device=q.device)
    v = torch.randn_like(k)
    q4 = q[:, :, None, :]  # [1, Hq, 1, D]
    ms = time_ms(lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True), q.device)
    del k, v
    torch.cuda.empty_cache()
    return ms


def check_correctness(device: torch.device, configs: list[dict]) -> dict:
    """paged_decode vs paged_decode_ref: 2 rows (8205 and 5000 tokens), mixed blocks, per-head tables."""
    gen = torch.Generator(device=device).manual_seed(0)
    block_tokens, max_blocks, n_slots = 32, 300, 700
    hot = torch.randn((n_slots, 2, NUM_KV_HEADS, block_tokens, HEAD_DIM), generator=gen, device=device).half()
    warm = torch.randint(-127, 128, hot.shape, generator=gen, device=device, dtype=torch.int8)
    k_scale = torch.rand((n_slots, NUM_KV_HEADS, HEAD_DIM), generator=gen, device=device) * 0.02 + 0.005
    v_scale = torch.rand((n_slots, NUM_KV_HEADS, block_tokens), generator=gen, device=device) * 0.02 + 0.005
    table = torch.randint(0, n_slots, (2, NUM_KV_HEADS, max_blocks), generator=gen, device=device).int()
    is_int8 = torch.rand(table.shape, generator=gen, device=device) < 0.5
    q = torch.randn((2, NUM_Q_HEADS, HEAD_DIM), generator=gen, device=device).half()
    num_tokens = torch.tensor([8205, 5000], dtype=torch.int32, device=device)
    args = (q, hot, warm, k_scale, v_scale, table, is_int8, num_tokens)
    ref_out, ref_mass = paged_decode_ref(*args, return_block_mass=True)
    result = {}
    for config in [{}] + configs:
        out, mass = paged_decode(*args, return_block_mass=True, **config)
        err_out = (out.float() - ref_out.float()).abs().max().item()
        err_mass = (mass - ref_mass).abs().max().item()
        key = ",".join(f"{k}={v}" for k, v in config.items()) or "default"
        result[key] = {"max_abs_err_out": err_out, "max_abs_err_mass": err_mass,
                       "ok": err_out < 5e-3 and err_mass < 1e-3}
    return result


def check_quantized(q: torch.Tensor) -> dict:
    """The fp8 and int4 cases' pools at 8K tokens: paged_decode's default walk vs paged_decode_ref."""
    pools, result = make_pools(8192, 32, q.device), {}
    for fmt in ("fp8", "int4"):
        args = case_args(pools, fmt, q)
        err = (paged_decode(*args)[0].float() - paged_decode_ref(*args)[0].float()).abs().max().item()
        result[f"{fmt} default"] = {"max_abs_err_out": err, "ok": err < 5e-3}
    return result


def print_rows(rows: list[dict]) -> None:
    print(f"{'tokens':>8} {'bt':>3} {'case':<10} {'config':<8} {'ms':>8} {'GB/s':>7} {'ceil':>5} {'vs sdpa':>7}")
    for r in rows:
        print(f"{r['tokens']:>8} {r['block_tokens']:>3} {r['case']:<10} {r['config']:<8} {r['ms']:>8.4f} "
              f"{r['GBps']:>7.0f} {r['of_ceiling']:>5.2f} {r['speed_vs_sdpa']:>6.2f}x")


def run_sweeps(q: torch.Tensor, seconds: float) -> tuple[dict, list[dict]]:
    """Best config per (pool, block size) at 1M tokens, each sweep given an equal share of the budget."""
    best, sweep_rows = {}, []
    for block_tokens in BLOCK_SIZES:
        pools = make_pools(CONTEXTS[-1], block_tokens, q.device)
        for case in ("fp16", "int8"):
            config, rows = sweep(pools, q, case, time.time() + seconds / (2 * len(BLOCK_SIZES)))
            sweep_rows += rows
            if config:
                best[(case, block_tokens)] = config
        del pools
        torch.cuda.empty_cache()
    return best, sweep_rows


def sdpa_row(num_tokens: int, block_tokens: int, ms: float, ceiling: float) -> dict:
    gbps = bytes_read("sdpa", num_tokens, block_tokens) / ms / 1e6
    return {"tokens": num_tokens, "block_tokens": block_tokens, "case": "sdpa", "config": "torch", "ms": ms,
            "GBps": gbps, "of_ceiling": gbps / ceiling, "speed_vs_sdpa": 1.0}


def summarize(rows: list[dict]) -> dict:
    """At 1M tokens: the fastest run of each pool format (any block size or config), fp16 and int8 against
    the targets (fp8 and int4 have none yet: target and met are None)."""
    summary = {}
    for kind in ("fp16", "int8", "fp8", "int4"):
        runs = [r for r in rows if r["tokens"] == CONTEXTS[-1] and r["case"] == kind]
        top, target = max(runs, key=lambda r: r["speed_vs_sdpa"]), TARGETS.get(kind)
        summary[kind] = {"speed_vs_sdpa": top["speed_vs_sdpa"], "target": target,
                         "met": None if target is None else top["speed_vs_sdpa"] >= target,
                         "block_tokens": top["block_tokens"], "config": top["config"], "ms": top["ms"],
                         "GBps": top["GBps"]}
    return summary


def parse_options(doc: str, out_name: str, sweep_seconds: float, sweep_help: str) -> argparse.Namespace:
    """--out DIR (where out_name goes), --quick and --sweep-seconds: the options of both decode kernel benches."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help=f"directory for {out_name}")
    parser.add_argument("--quick", action="store_true", help="default configs only, no sweep")
    parser.add_argument("--sweep-seconds", type=float, default=sweep_seconds, help=sweep_help)
    return parser.parse_args()


def baselines(device: torch.device) -> tuple[float, torch.Tensor, dict[int, float]]:
    """Seeded: the copy ceiling in GB/s, the decode query and SDPA's ms at every context."""
    torch.manual_seed(0)
    ceiling = copy_ceiling_GBps(device)
    q = torch.randn((1, NUM_Q_HEADS, HEAD_DIM), dtype=torch.float16, device=device)  # [1, Hq, D]
    return ceiling, q, {n: sdpa_ms(n, q) for n in CONTEXTS}


def main() -> None:
    opts = parse_options(__doc__, "kernel_bench.json", 50.0, "time budget of the config sweep")
    device = torch.device("cuda")
    ceiling, q, sdpa = baselines(device)
    best, sweep_rows = ({}, []) if opts.quick else run_sweeps(q, opts.sweep_seconds)
    rows = []
    for num_tokens, block_tokens in itertools.product(CONTEXTS, BLOCK_SIZES):
        rows.append(sdpa_row(num_tokens, block_tokens, sdpa[num_tokens], ceiling))
        rows += run_context(num_tokens, block_tokens, q, sdpa[num_tokens], ceiling, best)
    print(f"copy ceiling {ceiling:.0f} GB/s (read + write)")
    print_rows(rows)
    correctness = check_correctness(device, [{k: v for k, v in c.items() if k != "split_factor"}
                                             for c in best.values()]) | check_quantized(q)
    summary = summarize(rows)
    print("at 1M tokens:", json.dumps(summary))
    print("correctness vs reference:", json.dumps(correctness))
    result = {**environment(device), "copy_ceiling_GBps": ceiling, "summary_at_1M": summary, "rows": rows,
              "sweep": sweep_rows, "best_configs": {f"{k[0]}/bt{k[1]}": v for k, v in best.items()},
              "correctness": correctness}
    path = write_json(opts.out, "kernel_bench.json", result)
    print("wrote", path)


if __name__ == "__main__":
    main()
