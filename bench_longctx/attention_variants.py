"""Paged decode attention per layer in a CUDA graph: the split launch sequence against the one-tile walk.

    python -m bench_longctx.attention_variants --out DIR

Llama-3-8B attention (32 q / 8 kv heads, head_dim 128), batch 1, 64-token blocks, both pools present (what
the captured decode step passes) unless the case says warm-only. Cases:
    budget4096_mix     64 entries per kv head: 2 sink + 16 recent fp16 blocks around 46 int8 (the top-k step)
    budget4096_int8    64 entries, all int8
    dense8k_fp16       128 entries, all fp16
    dense16k_int8      256 entries, all int8 (past the one-tile threshold: where the walks cross)
    dense1m_int8       16384 entries, all int8 (int8_bench's "int8+hot"), and warm_only (its "int8")
Short cases capture 32 layers (distinct tables and slots, 0.8-3 GB of pools, so KV comes from HBM as
in the step) and report us per layer; the 1M cases capture one. Variants:
    old        the baseline launch sequence without the one-tile walk: partition_table, one split launch per
               pool, separate combine and block-mass kernels (below; the split kernel is split_walk.py's)
    auto       paged_decode as the step calls it (walk chosen by plan.decode_config)
    one_tile_tTOKENS_wWARPS   the one-tile walk at a forced tile size and warp count
    partition  the split walk with the one-launch merge (kvstore/attention/merge.py)
Per short case also the per-kernel time (torch profiler over graph replays).
Checks every variant against old (allclose) and the short cases against paged_decode_ref. ~2 min on an H200.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import triton
import triton.language as tl

from bench_longctx.timing import environment, write_json
from kvstore.attention.paged_decode import LOG2E, paged_decode
from kvstore.attention.split_walk import split_partials
from kvstore.attention.plan import DecodeGeometry, check_decode_inputs, decode_config
from kvstore.attention.reference import paged_decode_ref

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 32, 8, 128, 64
TARGET_US = 14.0  # the goal for the whole attention of a layer at budget 4096
SHORT_LAYERS = 32
ONE_TILE_CONFIGS = [(64, 4), (64, 8), (128, 4), (128, 8)]  # (tile tokens, warps)


@triton.jit
def _old_combine_kernel(
    o_part_ptr, lse_part_ptr, out_ptr, lse_ptr, s_out_batch, s_out_head, num_q_heads, num_splits,
    HEAD_DIM: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
):
    b = tl.program_id(0)
    qh = tl.program_id(1)
    row = b * num_q_heads + qh
    offs_s = tl.arange(0, SPLIT_CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    lse_max = tl.full([SPLIT_CHUNK], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, SPLIT_CHUNK):
        lse = tl.load(lse_part_ptr + row * num_splits + s0 + offs_s, mask=s0 + offs_s < num_splits, other=float("-inf"))
        lse_max = tl.maximum(lse_max, lse)
    m = tl.max(lse_max, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_sum = tl.zeros([SPLIT_CHUNK], tl.float32)
    acc = tl.zeros([SPLIT_CHUNK, HEAD_DIM], tl.float32)
    for s0 in range(0, num_splits, SPLIT_CHUNK):
        s_ok = s0 + offs_s < num_splits
        part = row * num_splits + s0 + offs_s
        w = tl.exp2(tl.load(lse_part_ptr + part, mask=s_ok, other=float("-inf")) - m)
        o = tl.load(o_part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0)
        acc += w[:, None] * o
        w_sum += w
    total = tl.sum(w_sum, 0)
    out = tl.sum(acc, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * s_out_batch + qh * s_out_head + offs_d, out.to(tl.float16))
    tl.store(lse_ptr + row, tl.where(total > 0, m + tl.log2(tl.where(total > 0, total, 1.0)), float("-inf")))


@triton.jit
def _old_block_mass_kernel(
    lse_block_ptr, lse_ptr, num_tokens_ptr, mass_ptr, num_kv_heads, max_blocks,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_TOKENS: tl.constexpr, MASS_CHUNK: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_j = tl.program_id(2) * MASS_CHUNK + tl.arange(0, MASS_CHUNK)
    offs_g = tl.arange(0, GROUP_PAD)
    n_blocks = tl.cdiv(tl.load(num_tokens_ptr + b), BLOCK_TOKENS)
    ok = (offs_g < GROUP)[:, None] & (offs_j < n_blocks)[None, :]
    rows = b * num_kv_heads * GROUP + head * GROUP + offs_g
    lse = tl.load(lse_ptr + rows, mask=offs_g < GROUP, other=0.0)
    lse_block = tl.load(lse_block_ptr + rows[:, None] * max_blocks + offs_j[None, :], mask=ok, other=0.0)
    mass = tl.sum(tl.where(ok, tl.exp2(lse_block - lse[:, None]), 0.0), 0) / GROUP
    tl.store(mass_ptr + (b * num_kv_heads + head) * max_blocks + offs_j, mass, mask=offs_j < max_blocks)


def old_paged_decode(q, hot, warm, k_scale, v_scale, table, is_int8, num_tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """The baseline with block mass: the split walk (partitioned over two pools), then separate combine and
    block-mass kernels."""
    geom = check_decode_inputs(q, hot, warm, k_scale, v_scale, table, is_int8, num_tokens)
    cfg = decode_config(geom, q.device, one_tile=False)  # the split walk's config, as paged_decode plans it
    args = (q, hot, warm.view(torch.int32), k_scale, v_scale, table, is_int8.view(torch.int8), num_tokens)
    o_part, lse_part, lse_block = split_partials(*args, geom, cfg, HEAD_DIM**-0.5 * LOG2E, True, "partition")
    b, nq, num_splits, d = o_part.shape
    out = torch.empty((b, nq, d), dtype=torch.float16, device=q.device)
    lse = torch.empty((b, nq), dtype=torch.float32, device=q.device)
    _old_combine_kernel[(b, nq)](o_part, lse_part, out, lse, out.stride(0), out.stride(1), nq, num_splits,
                                 HEAD_DIM=d, SPLIT_CHUNK=32, num_warps=4, num_stages=3)
    mass = torch.empty(table.shape, dtype=torch.float32, device=q.device)
    _old_block_mass_kernel[(b, NUM_KV_HEADS, triton.cdiv(geom.max_blocks, 256))](
        lse_block, lse, num_tokens, mass, NUM_KV_HEADS, geom.max_blocks, GROUP=geom.group,
        GROUP_PAD=triton.next_power_of_2(geom.group), BLOCK_TOKENS=BLOCK_TOKENS, MASS_CHUNK=256)
    return out, mass


def make_case(entries: int, layers: int, fp16_entries: torch.Tensor, num_tokens: int, warm_only: bool,
              dev: torch.device) -> dict:
    """Pools with `entries` slots per layer in each pool, per (layer, kv head) a random permutation of the
    layer's slots as its table; fp16_entries bool [entries] picks the pool per entry (the same for every head)."""
    n = layers * entries
    shape = (n, 2, NUM_KV_HEADS, BLOCK_TOKENS, HEAD_DIM)
    hot = torch.randn((0 if warm_only else n, *shape[1:]), dtype=torch.float16, device=dev)  # [n, 2, H, T, D]
    warm = torch.randint(-127, 128, shape, dtype=torch.int8, device=dev)
    k_scale = torch.rand((n, NUM_KV_HEADS, HEAD_DIM), device=dev) * 0.02 + 0.005  # [n, H, D]
    v_scale = torch.rand((n, NUM_KV_HEADS, BLOCK_TOKENS), device=dev) * 0.02 + 0.005  # [n, H, T]
    perm = torch.rand((layers, NUM_KV_HEADS, entries), device=dev).argsort(-1).int()  # [L, H, E]
    tables = perm + (torch.arange(layers, device=dev) * entries).int()[:, None, None]
    flags = (~fp16_entries.to(dev))[None, None, None].expand(layers, 1, NUM_KV_HEADS, entries)  # [L, 1, H, E]
    q = torch.randn((layers, 1, NUM_Q_HEADS, HEAD_DIM), device=dev).half()  # [L, 1, Hq, D]
    return dict(hot=hot, warm=warm, k_scale=k_scale, v_scale=v_scale, tables=tables[:, None], flags=flags, q=q,
                num_tokens=torch.tensor([num_tokens], dtype=torch.int32, device=dev), layers=layers)


def layer_args(case: dict, layer: int) -> tuple:
    return (case["q"][layer], case["hot"], case["warm"], case["k_scale"], case["v_scale"], case["tables"][layer],
            case["flags"][layer], case["num_tokens"])


def variants(short: bool) -> dict:
    found = {"old": old_paged_decode, "auto": lambda *a: paged_decode(*a, return_block_mass=True)}
    if short:
        for tokens, warps in ONE_TILE_CONFIGS:
            found[f"one_tile_t{tokens}_w{warps}"] = (
                lambda *a, bpi=tokens // BLOCK_TOKENS, w=warps: paged_decode(
                    *a, return_block_mass=True, walk="one_tile", blocks_per_iter=bpi, num_warps=w))
    found["partition"] = lambda *a: paged_decode(*a, return_block_mass=True, walk="partition")
    return found


def capture(fn, case: dict) -> torch.cuda.CUDAGraph:
    """Every layer's call once eagerly on a side stream (compiles), then all of them in one graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for layer in range(case["layers"]):
            fn(*layer_args(case, layer))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(case["layers"]):
            fn(*layer_args(case, layer))
    return graph


def us_per_layer(graph: torch.cuda.CUDAGraph, layers: int, seconds: float = 0.4) -> float:
    """Median over 5 batches of back-to-back replays, microseconds per layer."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    replays = max(3, int(seconds / 5 / max(start.elapsed_time(end) / 1e3, 1e-6)))
    times = []
    for _ in range(5):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / replays / layers)
    return statistics.median(times)


def kernel_us(graph: torch.cuda.CUDAGraph, layers: int, replays: int = 10) -> dict:
    """Per kernel name: device time per layer (us), from the torch profiler over graph replays."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    times = {e.key[:60]: _device_us(e) for e in prof.key_averages() if e.device_type.name == "CUDA"}
    return {name: round(us / replays / layers, 2) for name, us in times.items() if us > 0}


def _device_us(event) -> float:
    """An averaged profiler event's total device time (the attribute's name changed across torch versions)."""
    return getattr(event, "device_time_total", None) or event.cuda_time_total


def check(case: dict, outputs: dict, with_ref: bool) -> dict:
    """Every variant against old (and against paged_decode_ref) on layer 0: max abs errors, allclose."""
    base_out, base_mass = outputs["old"]
    refs = {"old": (base_out, base_mass)}
    if with_ref:
        refs["ref"] = paged_decode_ref(*layer_args(case, 0), return_block_mass=True)
    result = {}
    for name, (out, mass) in outputs.items():
        for ref_name, (ref_out, ref_mass) in refs.items():
            ok = torch.allclose(out.float(), ref_out.float(), atol=4e-3, rtol=1e-2) and \
                torch.allclose(mass, ref_mass, atol=1e-3, rtol=1e-2)
            result[f"{name}_vs_{ref_name}"] = {"ok": ok, "out_err": (out.float() - ref_out.float()).abs().max().item(),
                                               "mass_err": (mass - ref_mass).abs().max().item()}
    return result


def run_case(name: str, case: dict, short: bool) -> dict:
    geom = DecodeGeometry(1, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_TOKENS, case["tables"].shape[-1])
    cfg = decode_config(geom, torch.device("cuda"))
    row = {"case": name, "entries": geom.max_blocks, "num_tokens": int(case["num_tokens"][0]), "layers": case["layers"],
           "auto_config": {"one_tile": cfg.one_tile, "splits": cfg.num_splits, "blocks_per_iter": cfg.blocks_per_iter,
                           "num_warps": cfg.num_warps}, "us_per_layer": {}, "kernels_us_per_layer": {}}
    outputs, row["errors"] = {}, {}
    for label, fn in variants(short).items():
        try:  # one failing variant (a compile error, say) is recorded; the others still run
            outputs[label] = fn(*layer_args(case, 0))
            graph = capture(fn, case)
            row["us_per_layer"][label] = us_per_layer(graph, case["layers"])
            if short and label in ("old", "auto"):
                row["kernels_us_per_layer"][label] = kernel_us(graph, case["layers"])
            del graph
        except Exception as e:  # noqa: BLE001 (reported in the result file)
            row["errors"][label] = repr(e)[:2000]
            print(f"{name} {label}: {e!r}"[:2000], flush=True)
        torch.cuda.synchronize()
    row["correct"] = check(case, outputs, with_ref=short)
    row["all_ok"] = not row["errors"] and all(c["ok"] for c in row["correct"].values())
    us = row["us_per_layer"]
    row["old_over_auto"] = us["old"] / us["auto"]
    print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in us.items()) + f" us/layer; all_ok={row['all_ok']}",
          flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for attention_variants.json")
    opts = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    start = time.time()
    idx = torch.arange(64)
    mix = (idx < 2) | (idx >= 48)  # 2 sink and 16 recent fp16 blocks
    cases = [
        ("budget4096_mix", 64, SHORT_LAYERS, mix, 63 * 64 + 37, False),
        ("budget4096_int8", 64, SHORT_LAYERS, torch.zeros(64, dtype=torch.bool), 63 * 64 + 37, False),
        ("dense8k_fp16", 128, SHORT_LAYERS, torch.ones(128, dtype=torch.bool), 8192 - 11, False),
        ("dense16k_int8", 256, SHORT_LAYERS, torch.zeros(256, dtype=torch.bool), 16384 - 5, False),
        ("dense1m_int8", 16384, 1, torch.zeros(16384, dtype=torch.bool), 1 << 20, False),
        ("dense1m_int8_warm_only", 16384, 1, torch.zeros(16384, dtype=torch.bool), 1 << 20, True),
    ]
    rows = []
    for name, entries, layers, fp16_entries, num_tokens, warm_only in cases:
        case = make_case(entries, layers, fp16_entries, num_tokens, warm_only, device)
        rows.append(run_case(name, case, short=layers > 1))
        del case
        torch.cuda.empty_cache()
    mix_row = rows[0]
    summary = {"budget4096_mix_old_us": mix_row["us_per_layer"]["old"], "budget4096_mix_auto_us":
               mix_row["us_per_layer"]["auto"], "target_us": TARGET_US,
               "met": mix_row["us_per_layer"]["auto"] <= TARGET_US,
               "fastest_per_case": {r["case"]: min(r["us_per_layer"], key=r["us_per_layer"].get) for r in rows},
               "dense1m_auto_over_old": {r["case"]: r["us_per_layer"]["auto"] / r["us_per_layer"]["old"]
                                         for r in rows if r["case"].startswith("dense1m")},
               "all_ok": all(r["all_ok"] for r in rows)}
    print("summary:", summary)
    result = {**environment(device), "summary": summary, "rows": rows, "seconds": time.time() - start}
    print("wrote", write_json(opts.out, "attention_variants.json", result))


if __name__ == "__main__":
    main()
