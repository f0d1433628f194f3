"""The captured decode step's topk select (issue 10): Quest scores, then top k blocks per kv head and their
kernel block table, as of 93b8cca (quest_scores_live, then topk_block_table's chunk and merge launches;
its top-k kernels frozen below) against QuestSelect (eviction/topk_kernel.py: one launch, the top-k
stages folded into the Quest scan), at 1M and 128K tokens, llama3-8b geometry (32 q / 8 kv heads,
head_dim 128), 64-token blocks, budget 4096 (k = 64 blocks per kv head).

    PYTHONPATH=. python3 -m bench_longctx.select_variants --out DIR

Capacity as DecodeStep preallocates it (context + max(16384, context / 16) tokens); the device count
holds context - 1 tokens. Every path runs over --layers layers, each with its own summaries (so L2 holds
none of them, as in a decode token), captured in one CUDA graph; us per layer = replay time / layers,
median of --repeats timings of --replays replays (CUDA events). Rows:
    old              quest_scores_live + the frozen chunk and merge launches (the step's path before)
    old_quest        quest_scores_live alone;  old_topk: the frozen two launches alone, over its scores
    quest_heads_fast the same Quest kernel over a grid whose consecutive programs are the kv heads of one
                     block tile (contiguous summary reads: QuestSelect's order), scores only
    quest_all_heads  scores only, one program reading every head of 8 or 16 blocks (one dot of all q heads)
    topk_kth         topk_block_table as now (k-th key found top bit first), over the same scores
    new[...]         QuestSelect per setting (SETTINGS; past the first context the default and its fastest)
Every new setting is checked against old on the GPU: selected / slots / is_int8 exactly ("equal"; the graph's
outputs after all replays), scores bitwise (block_n 64 runs old's dot tile; other tiles may round apart), the
workspace back to its start state; layer 0 has a tie group straddling the k-th score of head 0.
Writes DIR/select_variants.json.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from bench_longctx.timing import environment, write_json
from eviction.quest_kernel import _quest_tile, quest_scores_live
from eviction.topk_kernel import CHUNK, QuestSelect, _keys, topk_block_table, topk_sorted_ref

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
INT8_TIER = 1
SETTINGS = [  # QuestSelect fields; the first is the default
    dict(block_n=64, chunk=1024, num_warps=8, maxnreg=48, merge_in_kernel=True, search_bits=2),
    dict(block_n=64, chunk=1024, num_warps=8, maxnreg=48, merge_in_kernel=True, search_bits=1),
    dict(block_n=64, chunk=1024, num_warps=8, maxnreg=None, merge_in_kernel=True, search_bits=2),
    dict(block_n=64, chunk=1024, num_warps=8, maxnreg=40, merge_in_kernel=True, search_bits=2),
    dict(block_n=64, chunk=1024, num_warps=8, maxnreg=48, merge_in_kernel=False, search_bits=2),
    dict(block_n=64, chunk=2048, num_warps=8, maxnreg=48, merge_in_kernel=True, search_bits=2),
    dict(block_n=32, chunk=1024, num_warps=8, maxnreg=48, merge_in_kernel=True, search_bits=2),
    dict(block_n=64, chunk=1024, num_warps=4, maxnreg=80, merge_in_kernel=True, search_bits=2),
    # one warp: no cross-warp reduction in the counting passes, up to 32 programs per SM for the scan
    dict(block_n=16, chunk=1024, num_warps=1, maxnreg=None, merge_in_kernel=False, search_bits=1),
    dict(block_n=16, chunk=1024, num_warps=1, maxnreg=None, merge_in_kernel=True, search_bits=1),
]


# -- 93b8cca's top-k stages, frozen (bisection on the int64 midpoint) -------------------------------------
@triton.jit
def _old_bisect(key, k):
    lo = tl.full((), -2147483648, tl.int64)
    hi = tl.full((), 2147483647, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        count = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), axis=0)
        lo = tl.where(count >= k, mid, lo)
        hi = tl.where(count >= k, hi, mid - 1)
    return lo.to(tl.int32)


@triton.jit
def _old_winners(key, k):
    t = _old_bisect(key, k)
    above = key > t
    tied = key == t
    need = k - tl.sum(above.to(tl.int32), axis=0)
    return above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= need))


@triton.jit
def _old_chunk_kernel(scores_ptr, s_row, n, k, cand_key_ptr, cand_idx_ptr, s_cand, CHUNK: tl.constexpr):
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = offs < n
    x = tl.load(scores_ptr + row * s_row + offs, mask=valid, other=float("-inf")).to(tl.float32)
    key = _keys(x, valid)
    take = _old_winners(key, k)
    pos = chunk * k + tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(cand_key_ptr + row * s_cand + pos, key, mask=take)
    tl.store(cand_idx_ptr + row * s_cand + pos, offs, mask=take)


@triton.jit
def _old_merge_kernel(cand_key_ptr, cand_idx_ptr, s_cand, num_cand, k, out_ptr, s_out, slot_map_ptr, tier_map_ptr,
                      slots_ptr, is_int8_ptr, s_table, int8_tier, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    valid = offs < num_cand
    key = tl.load(cand_key_ptr + row * s_cand + offs, mask=valid, other=-2147483647 - 1)
    idx = tl.load(cand_idx_ptr + row * s_cand + offs, mask=valid, other=0)
    take = _old_winners(key, k) & valid
    pos = tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + row * s_out + pos, idx.to(tl.int64), mask=take)
    slot = tl.load(slot_map_ptr + idx, mask=take, other=0)
    tier = tl.load(tier_map_ptr + idx, mask=take, other=0)
    tl.store(slots_ptr + row * s_table + pos, slot, mask=take)
    tl.store(is_int8_ptr + row * s_table + pos, tier == int8_tier, mask=take)


def old_topk_block_table(scores, k, slot_map, tier_map, int8_tier):
    rows, n = scores.shape
    chunks = triton.cdiv(n, CHUNK)
    cand_key = torch.empty((rows, chunks * k), dtype=torch.int32, device=scores.device)
    cand_idx = torch.empty_like(cand_key)
    _old_chunk_kernel[(chunks, rows)](scores, scores.stride(0), n, k, cand_key, cand_idx, cand_key.stride(0),
                                      CHUNK=CHUNK, num_warps=4)
    out = torch.empty((rows, k), dtype=torch.int64, device=scores.device)
    slots = torch.empty((rows, k), dtype=torch.int32, device=scores.device)
    is_int8 = torch.empty((rows, k), dtype=torch.bool, device=scores.device)
    block = max(triton.next_power_of_2(chunks * k), 128)
    _old_merge_kernel[(rows,)](cand_key, cand_idx, cand_key.stride(0), chunks * k, k, out, out.stride(0), slot_map,
                               tier_map, slots, is_int8, slots.stride(0), int8_tier, BLOCK=block,
                               num_warps=max(4, min(32, block // 1024)))
    return out, slots, is_int8


@triton.jit(do_not_specialize=["num_blocks", "sink_blocks", "recent", "block_tokens"])
def _quest_heads_fast_kernel(q_ptr, s_ptr, out_ptr, count_ptr, num_blocks, sink_blocks, recent, block_tokens,
                             stride_qh, stride_sn, stride_sm, stride_sh, stride_oh, NUM_HEADS: tl.constexpr,
                             GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """quest_scores_live's kernel, programs ordered (block tile, kv head) with heads fastest."""
    head = tl.program_id(0) % NUM_HEADS
    offs_n = tl.program_id(0) // NUM_HEADS * BLOCK_N + tl.arange(0, BLOCK_N)
    score = _quest_tile(q_ptr, s_ptr, count_ptr, offs_n, head, num_blocks, sink_blocks, recent, block_tokens,
                        stride_qh, stride_sn, stride_sm, stride_sh, GROUP, 16, HEAD_DIM, HEAD_DIM, BLOCK_N, True,
                        True, True)
    tl.store(out_ptr + head * stride_oh + offs_n, score, mask=offs_n < num_blocks)


def quest_heads_fast(q, summaries, count, *, block_tokens, sink_blocks, recent_tokens):
    n = summaries.shape[0]
    out = torch.empty((NUM_KV_HEADS, n), dtype=torch.float32, device=q.device)
    _quest_heads_fast_kernel[(triton.cdiv(n, 64) * NUM_KV_HEADS,)](
        q, summaries, out, count, n, sink_blocks, recent_tokens, block_tokens, q.stride(0), summaries.stride(0),
        summaries.stride(1), summaries.stride(2), out.stride(0), NUM_HEADS=NUM_KV_HEADS,
        GROUP=NUM_Q_HEADS // NUM_KV_HEADS, HEAD_DIM=HEAD_DIM, BLOCK_N=64, num_warps=8)
    return out


@triton.jit(do_not_specialize=["num_blocks", "sink_blocks", "recent", "block_tokens"])
def _quest_all_heads_kernel(q_ptr, s_ptr, out_ptr, count_ptr, num_blocks, sink_blocks, recent, block_tokens,
                            stride_sn, stride_sm, stride_sh, stride_oh, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Scores only, one program per BLOCK_N blocks and every kv head (one contiguous read of BLOCK_N * 4 KiB):
    rows (block, head) against all q heads in one dot, each row keeping its own group's columns."""
    rows = tl.arange(0, BLOCK_N * NUM_HEADS)  # block-major, heads fastest: the summaries' order
    offs_n = tl.program_id(0) * BLOCK_N + rows // NUM_HEADS
    head = rows % NUM_HEADS
    offs_d = tl.arange(0, HEAD_DIM)
    n = tl.load(count_ptr) + 1
    live = (n + block_tokens - 1) // block_tokens
    tile = s_ptr + offs_n[:, None].to(tl.int64) * stride_sn + head[:, None] * stride_sh + offs_d[None, :]
    mask = ((offs_n < live) & (offs_n < num_blocks))[:, None]
    k_min = tl.load(tile, mask=mask, other=0.0)  # [BLOCK_N * H, D]
    k_max = tl.load(tile + stride_sm, mask=mask, other=0.0)
    q = tl.load(q_ptr + tl.arange(0, NUM_HEADS * GROUP)[:, None] * HEAD_DIM + offs_d[None, :])  # [Hq, D]
    zero = tl.zeros_like(q)
    bound = tl.dot(k_max, tl.trans(tl.maximum(q, zero)))  # [BLOCK_N * H, Hq]
    bound = tl.dot(k_min, tl.trans(tl.minimum(q, zero)), bound)
    own = (tl.arange(0, NUM_HEADS * GROUP) // GROUP)[None, :] == head[:, None]
    score = tl.max(tl.where(own, bound, float("-inf")), axis=1)
    score = tl.where(score != score, float("-inf"), tl.minimum(score, 3.4028234663852886e38))
    start = tl.minimum(tl.maximum(n - recent, 0) // block_tokens, live - 1)
    protected = (offs_n < sink_blocks) | (offs_n >= start)
    score = tl.where(offs_n < live, tl.where(protected, float("inf"), score), float("-inf"))
    tl.store(out_ptr + head * stride_oh + offs_n, score, mask=offs_n < num_blocks)


def quest_all_heads(q, summaries, count, block_n, *, block_tokens, sink_blocks, recent_tokens):
    n = summaries.shape[0]
    out = torch.empty((NUM_KV_HEADS, n), dtype=torch.float32, device=q.device)
    _quest_all_heads_kernel[(triton.cdiv(n, block_n),)](
        q, summaries, out, count, n, sink_blocks, recent_tokens, block_tokens, summaries.stride(0),
        summaries.stride(1), summaries.stride(2), out.stride(0), NUM_HEADS=NUM_KV_HEADS,
        GROUP=NUM_Q_HEADS // NUM_KV_HEADS, HEAD_DIM=HEAD_DIM, BLOCK_N=block_n, num_warps=4)
    return out


# -- inputs, timing, checks --------------------------------------------------------------------------------
def make_layers(context: int, args, device) -> dict:
    """Per layer q [32, 128] and summaries [capacity, 2, 8, 128] (live blocks: per-block centres and spreads,
    8 outlier channels; capacity past the sequence: NaN/inf garbage the kernels must not read)."""
    b = args.block_tokens
    capacity = -(-(context + max(16384, context // 16)) // b)
    live = -(-context // b)
    g = torch.Generator(device=device).manual_seed(context)
    layers = []
    for _ in range(args.layers):
        centre = torch.randn(capacity, NUM_KV_HEADS, HEAD_DIM, device=device, generator=g) * 0.3
        spread = 2.2 + 0.4 * torch.rand(capacity, NUM_KV_HEADS, HEAD_DIM, device=device, generator=g)
        summaries = torch.stack([centre - spread, centre + spread], 1)  # [N, 2, H, D]
        summaries[..., :8] *= 8.0
        summaries = summaries.half()
        summaries[live:, 0] = float("nan")
        summaries[live:, 1] = float("inf")
        q = torch.randn(NUM_Q_HEADS, HEAD_DIM, device=device, generator=g).half()
        layers.append((q, summaries))
    count = torch.tensor([context - 1], dtype=torch.int64, device=device)
    slot_map = torch.randint(0, 1 << 20, (capacity + 64,), device=device, generator=g, dtype=torch.int32)
    tier_map = torch.randint(0, 3, (capacity + 64,), device=device, generator=g, dtype=torch.int8)
    kw = dict(block_tokens=b, sink_blocks=-(-args.sink // b), recent_tokens=args.recent)
    k = args.budget // b
    scores = quest_scores_live(layers[0][0], layers[0][1], count, **kw)[0]  # a tie group at head 0's k-th score
    order = scores[kw["sink_blocks"]:live - args.recent // b - 2].sort(descending=True).indices + kw["sink_blocks"]
    tie_source, tie_targets = order[k - 20], order[k + 5: k + 205]
    layers[0][1][tie_targets] = layers[0][1][tie_source].clone()
    return dict(layers=layers, count=count, slot_map=slot_map, tier_map=tier_map, kw=kw, k=k,
                capacity=capacity, live=live)


def graph_us(run, num_layers: int, args) -> tuple[float, list]:
    """us per layer of run(layer) for every layer, replayed from one CUDA graph; and the graph's outputs."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for layer in range(num_layers):
            run(layer)  # compiles
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = [run(layer) for layer in range(num_layers)]
    graph.replay()
    times = []
    for _ in range(args.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / (args.replays * num_layers))
    return statistics.median(times), outputs


def compare(new: list, old: list) -> dict:
    """Outputs per layer, (selected, slots, is_int8, scores) each."""
    same = [all(torch.equal(a, b) for a, b in zip(n[:3], o[:3])) for n, o in zip(new, old)]
    scores_same = [torch.equal(n[3], o[3]) for n, o in zip(new, old)]
    diff = max(float((n[3] - o[3]).nan_to_num(0.0).abs().max()) for n, o in zip(new, old))
    own = [torch.equal(n[0], topk_sorted_ref(n[3], n[0].shape[1])) for n in new]  # a kernel bug, or rounding?
    return {"table_equal_layers": sum(same), "scores_bitwise_equal_layers": sum(scores_same),
            "scores_max_abs_diff": diff, "selected_is_topk_of_own_scores_layers": sum(own),
            "equal": all(same)}  # scores of a different dot tile may round apart


def workspace_reset(plan: QuestSelect) -> bool:
    try:
        plan.check_integrity()
        return True
    except AssertionError:
        return False


def attempt(timed, checks) -> dict:
    """{"us", **checks(outputs)}, or the error: one failing case (resources, a compiler error) must not cost
    the run."""
    try:
        us, out = timed()
        return {"us": us, **checks(out)}
    except Exception as e:  # noqa: BLE001
        return {"us": float("inf"), "equal": False, "error": f"{type(e).__name__}: {e}"[:500]}


def bench_context(context: int, args, device, settings: list[dict]) -> dict:
    d = make_layers(context, args, device)
    layers, count, kw, k, n = d["layers"], d["count"], d["kw"], d["k"], len(d["layers"])
    maps = (d["slot_map"], d["tier_map"], INT8_TIER)
    row = {"context": context, "capacity_blocks": d["capacity"], "live_blocks": d["live"], "k": k, **kw,
           "summary_MiB_read_per_layer": d["live"] * 2 * NUM_KV_HEADS * HEAD_DIM * 2 / 2**20}

    def old(layer):
        q, s = layers[layer]
        scores = quest_scores_live(q, s, count, **kw)
        return (*old_topk_block_table(scores, k, *maps), scores)

    row["old_us"], old_out = graph_us(old, n, args)
    scores = [o[3] for o in old_out]
    row["old_quest_us"], _ = graph_us(lambda i: quest_scores_live(*layers[i], count, **kw), n, args)
    row["old_topk_us"], _ = graph_us(lambda i: old_topk_block_table(scores[i], k, *maps), n, args)
    row["topk_kth_us"], kth = graph_us(lambda i: topk_block_table(scores[i], k, *maps), n, args)
    row["topk_kth_equal"] = all(all(torch.equal(a, b) for a, b in zip(x, o[:3])) for x, o in zip(kth, old_out))
    scans = {"quest_heads_fast": lambda i: quest_heads_fast(*layers[i], count, **kw),
             "quest_all_heads_8": lambda i: quest_all_heads(*layers[i], count, 8, **kw),
             "quest_all_heads_16": lambda i: quest_all_heads(*layers[i], count, 16, **kw)}
    for name, scan in scans.items():  # scores only: the scan's share
        row[name] = attempt(lambda: graph_us(scan, n, args), lambda out: {
            "bitwise_equal_layers": sum(torch.equal(a, b) for a, b in zip(out, scores))})
    row["new"] = []
    for setting in settings:
        plan = QuestSelect(d["capacity"], NUM_KV_HEADS, k, device, **setting)
        check = attempt(lambda: graph_us(lambda i: plan(*layers[i], count, *maps, **kw), n, args), lambda out: {
            **compare(out, old_out), "workspace_reset": workspace_reset(plan)})
        row["new"].append({**setting, **check})
        print(f"  {context:>8} new {setting}: {check}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for select_variants.json")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1 << 20, 1 << 17])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument("--sink", type=int, default=64)
    parser.add_argument("--recent", type=int, default=1024)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("select_variants needs a CUDA device")
    device = torch.device("cuda")
    rows, settings = [], SETTINGS
    for context in args.contexts:  # past the first context: the default and the first context's fastest
        rows.append(bench_context(context, args, device, settings))
        best = min(rows[0]["new"], key=lambda x: x["us"] if x["equal"] else float("inf"))
        settings = [SETTINGS[0]] + [s for s in SETTINGS[1:] if all(best[key] == s[key] for key in s)]
        torch.cuda.empty_cache()
    result = {"environment": environment(device), "args": vars(args),
              "geometry": {"num_q_heads": NUM_Q_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM},
              "rows": rows}
    path = write_json(args.out, "select_variants.json", result)
    for r in rows:
        best = min(r["new"], key=lambda x: x["us"] if x["equal"] else float("inf"))
        print(f"{r['context']:>8} tokens: old {r['old_us']:.2f} us/layer (quest {r['old_quest_us']:.2f}, heads-fast "
              f"quest {r['quest_heads_fast']['us']:.2f}, all-heads quest {r['quest_all_heads_8']['us']:.2f} / "
              f"{r['quest_all_heads_16']['us']:.2f}, top-k {r['old_topk_us']:.2f}, k-th top-k {r['topk_kth_us']:.2f}); "
              f"new default {r['new'][0]['us']:.2f} (equal {r['new'][0]['equal']}), best {best['us']:.2f} "
              f"{ {key: best[key] for key in SETTINGS[0]} }")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
