"""`kvtier bench serve`: many long-context requests at once through engine_adapter.serving.Scheduler.

A request trace (arrival times: all at once, or Poisson at serve.arrival_rate; context lengths cycled from
serve.contexts; serve.output_tokens each) runs with continuous batching, a model of the geometry with random
weights (bench_longctx/e2e.py), every generated token appended to the store and the K/V appended for each
request checked when it finishes. Contexts are written as random K/V (decode reads the same bytes as after a
prefill; the prefill itself is not timed here). Three stores run the same trace, one after another:
  kvtier      the tiers: fp16 hot window, serve.warm_format (int8, fp8 or int4) warm on the GPU as far as it
              holds, the same format in the cpu tier beyond it;
              serve.mode (topk: Quest's bound) at serve.budget tokens, through the captured batch step
  dense-fp16  every token fp16 on the GPU, dense attention: what a dense paged engine holds (the requests
              that do not fit wait)
  dense-int8  every token int8 on the GPU, dense attention
On CUDA an untimed warm-up trace (2 requests, 2 tokens) runs before each store's, so kernel compilation is
not in its numbers. Each reports aggregate output tokens/s over the run (fills excluded), time per output
token p50 / p99, and the same over steady steps (neither a fill nor a CUDA graph capture in them: kvtier's
topk requests decode in rows that they join and leave without a capture, a new row or width bucket captures
once, as engines capture at start-up; dense batches capture per membership), queueing, preemptions, graph
captures, steady steps' time where a running sequence opens new tail blocks (a block boundary) and elsewhere,
the most requests running at once, blocks per tier at that peak, the cpu tier's reads (head slices the
captured steps staged, in all and per output token; blocks fetched eagerly; blocks promoted to the warm tier
and warm blocks swapped down for them: serve.promotions_per_boundary, 0 for none) and the fraction of each
request's appended K/V found intact, and the garbage collections during the run (the heap frozen before it, as a
serving process does once loaded: kvstore/heap.py). serve.batch_sizes adds a sweep: a fixed batch of that many
requests of the first context, kvtier only, for the throughput / p99 vs batch size plot.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time

import torch

from bench_longctx.e2e import appended_kv_matches
from bench_longctx.e2e_setup import CHUNK, available_bytes, model_args, random_model
from bench_longctx.presets import ServePreset
from bench_longctx.timing import Deadline, GcPauses, release
from engine_adapter.decoder import Decoder
from engine_adapter.serving import Request, Scheduler
from kvstore.blocks.table import TableTensors
from kvstore.blocks.tier_stack import staging_bytes
from kvstore.config import Config
from kvstore.heap import frozen_heap
from kvstore.store import KVStore
from tiers.layout import BlockLayout

STORES = ("kvtier", "dense-fp16", "dense-int8")
SINK = 64


def trace(p: ServePreset, num_requests: int, contexts: tuple[int, ...], seed: int = 0) -> list[Request]:
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(num_requests):
        out.append(Request(f"r{i}", max_new_tokens=p.output_tokens, context_tokens=contexts[i % len(contexts)],
                           arrival_s=t))
        if p.arrival_rate > 0:
            t += rng.expovariate(p.arrival_rate)
    return out


def serve_store(kind: str, p: ServePreset, spec, device: torch.device, requests: list[Request]) -> KVStore:
    """The store of one column: kvtier's tiers, or everything on the GPU in one format (no cpu tier to speak of).
    The GPU pools get what the device has left after the model, the staging rows and the block index of the
    requests that can run at once (summaries and sketch codes: TableTensors.bytes_per_block; a decode step
    reserves its table for the length + max(16K, 1/16))."""
    warm_format = p.warm_format if kind == "kvtier" else "int8"  # dense-int8 is the int8 baseline
    layout = BlockLayout.of(spec, p.block_tokens, warm_format)
    longest, total = max(r.length for r in requests), sum(r.length for r in requests)
    sketch_codes = p.mode == "sketch" and kind == "kvtier"  # the codes cost device memory only mode="sketch" reads
    per_block = TableTensors(spec.num_kv_heads, spec.head_dim, p.block_tokens, device, sketch_codes).bytes_per_block()
    index_of = lambda n: spec.num_layers * per_block * -(-(n + max(16384, n // 16)) // p.block_tokens)  # noqa: E731
    concurrent = sorted((r.length for r in requests), reverse=True)[: p.max_batch]
    if kind != "kvtier":  # as many as the device holds in one format, each with its index
        kv = layout.fp16_bytes if kind == "dense-fp16" else layout.int8_bytes
        room, fit = available_bytes(device), []
        for n in concurrent:
            need = spec.num_layers * -(-n // p.block_tokens) * kv + index_of(n)
            if need > room:
                break
            room -= need
            fit.append(n)
        concurrent = fit or concurrent[:1]
    index = sum(index_of(n) for n in concurrent)
    staging_tokens = max(p.budget, 1024) * min(p.max_batch, len(requests)) if kind == "kvtier" else p.block_tokens
    gpu = (int(p.gpu_gib * (1 << 30)) or available_bytes(device) - index) - staging_bytes(layout, staging_tokens)
    warm_per_token = spec.num_layers * layout.warm_bytes / p.block_tokens
    if kind == "dense-fp16":
        hot, warm, cpu = longest, 0, 64 << 20
    elif kind == "dense-int8":
        hot, warm, cpu = p.block_tokens, longest, 64 << 20
    else:
        hot, warm = p.hot_tokens, longest
        cpu = max(64 << 20, int(1.1 * total * warm_per_token - gpu))  # what the GPU pools cannot take
    config = Config(model=spec, block_tokens=p.block_tokens, sink_tokens=SINK, hot_tokens=hot, warm_tokens=warm,
                    recent_tokens=p.recent_tokens, gpu_bytes=gpu + staging_bytes(layout, staging_tokens),
                    staging_tokens=staging_tokens, cpu_bytes=cpu, cpu_dtype=warm_format, device=str(device),
                    host_memory_reserve=0, sketch_codes=sketch_codes, warm_format=warm_format,
                    hot_sequences=len(concurrent) if kind == "kvtier" else 1,
                    promotions_per_boundary=p.promotions_per_boundary)
    return KVStore(config)


def fill_random(store: KVStore, seq: int, num_tokens: int) -> None:
    spec, dev = store.spec, store.device
    g = torch.Generator(device=dev).manual_seed(seq)
    for layer in range(spec.num_layers):
        for start in range(0, num_tokens, CHUNK):
            n = min(CHUNK, num_tokens - start)
            k = torch.randn((n, spec.num_kv_heads, spec.head_dim), device=dev, generator=g)
            k[..., :8] *= 6  # outlier channels, as real keys have
            v = torch.randn((n, spec.num_kv_heads, spec.head_dim), device=dev, generator=g)
            store.append(seq, layer, k.half(), v.half())


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def run_trace(kind: str, model, p: ServePreset, requests: list[Request], device: torch.device) -> dict:
    store = serve_store(kind, p, model.args.spec, device, requests)
    warm_format = store.config.warm_format if store.config.warm_tokens else "none"  # dense-fp16 keeps no warm
    mode = p.mode if kind == "kvtier" else "dense"
    intact: list[bool] = []
    decoder = Decoder(model, store)

    def check(request: Request) -> None:  # layer 0's K/V of every generated token but the last, as appended
        start = request.context_tokens
        cooled = len(request.output) > store.config.hot_tokens  # generated tokens past the fp16 window: warm
        intact.append(appended_kv_matches(decoder, request.seq, start, request.output[:-1],
                                          store.config.warm_format if cooled else None))

    fill_s = [0.0]

    def fill(store_: KVStore, seq: int, n: int) -> None:
        began = time.perf_counter()
        fill_random(store_, seq, n)
        if device.type == "cuda":
            torch.cuda.synchronize()
        fill_s[0] += time.perf_counter() - began

    collections = GcPauses()  # the collector's pauses during the run
    try:
        scheduler = Scheduler(decoder, mode, p.budget, p.max_batch, fill=fill, on_finish=check)
        for r in requests:
            scheduler.submit(r)
        most, peak_tiers, admit_steps, step_s, step_end, step_tokens, opening = 0, None, set(), [], [], [], []
        admitted = lambda: sum(r.admitted_s is not None for r in requests) + scheduler.preemptions  # noqa: E731
        collections.start()
        began = time.perf_counter()
        while scheduler.pending:
            # whether a running sequence opens new tail blocks in this step (a block boundary)
            opening.append(any(decoder.length(r.seq) % p.block_tokens == 0 for r in scheduler.running))
            before, captured, t0 = admitted(), decoder.graph_decoders.captures, time.perf_counter()
            produced = scheduler.step()
            step_s.append(time.perf_counter() - t0)
            if admitted() != before or decoder.graph_decoders.captures != captured:  # a fill or a capture: not steady
                admit_steps.add(len(step_s) - 1)
            step_end.append(scheduler.now())
            step_tokens.append(len(produced))
            if len(scheduler.running) > most:
                most, peak_tiers = len(scheduler.running), {k: v["blocks"] for k, v in store.stats()["tiers"].items()}
            if not produced and not scheduler.running:
                time.sleep(0.001)
        wall = time.perf_counter() - began
        done, preemptions = scheduler.finished, scheduler.preemptions
        captures = decoder.graph_decoders.captures
        attend = store.stats()["attend"]  # cpu reads: slices the captured steps staged, blocks moved up and down
        cold = {k: attend[k] for k in ("cold_slices_staged", "cold_blocks_fetched", "promotions", "promotion_swaps")}
    finally:
        collections.stop()
        store.close()
        del decoder, store
        scheduler = None  # the last reference to the store's pools and captured graphs (run_serve then gives
        # the memory back to the driver: empty_cache frees only blocks nothing references)
    tokens = sum(len(r.output) for r in done)
    gaps = [b - a for r in done for a, b in zip(r.token_s, r.token_s[1:])]
    steady = [s for i, s in enumerate(step_s) if i not in admit_steps]
    by_kind = {kind: [s for i, s in enumerate(step_s) if i not in admit_steps and opening[i] == at]
               for kind, at in (("opening_tails", True), ("other", False))}
    # steady: output tokens of steps with neither a fill nor a capture, over those steps' time
    unsteady_ends = [step_end[i] for i in admit_steps]
    steady_gaps = [b - a for r in done for a, b in zip(r.token_s, r.token_s[1:])
                   if not any(a < e <= b for e in unsteady_ends)]
    return {"store": kind, "warm_format": warm_format, "mode": mode, "requests": len(done), "output_tokens": tokens,
            "wall_s": wall, "fill_s": fill_s[0], "tokens_per_s": tokens / max(wall - fill_s[0], 1e-9),
            "tpot_ms_p50": 1e3 * (percentile(gaps, 50) or 0), "tpot_ms_p99": 1e3 * (percentile(gaps, 99) or 0),
            "tpot_ms_max": 1e3 * max(gaps, default=0),
            "step_ms_p99_without_admissions": 1e3 * (percentile(steady, 99) or 0),
            "steady_tpot_ms_p50": 1e3 * (percentile(steady_gaps, 50) or 0),
            "steady_tpot_ms_p99": 1e3 * (percentile(steady_gaps, 99) or 0),
            "steady_tokens_per_s": sum(n for i, n in enumerate(step_tokens) if i not in admit_steps)
            / max(sum(steady), 1e-9), "graph_captures": captures, "steps": len(step_s),
            "steps_with_fill_or_capture": len(admit_steps),
            "steady_step_ms": {kind: {"steps": len(x), "p50": 1e3 * (percentile(x, 50) or 0),
                                      "max": 1e3 * max(x, default=0)} for kind, x in by_kind.items()},
            "queue_s_mean": statistics.mean(r.admitted_s - r.arrival_s for r in done),
            "queue_s_max": max(r.admitted_s - r.arrival_s for r in done), "preemptions": preemptions,
            "most_running": most, "peak_blocks_per_tier": peak_tiers,
            "cold": cold, "cold_slices_per_output_token": cold["cold_slices_staged"] / max(tokens, 1),
            "appended_verified": f"{sum(intact)}/{len(intact)}", "gc": collections.summary()}


def guarded(run) -> dict:
    """A failed run is recorded with its error (the device memory it held given back); the others go on."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 -- recorded in the results
        return {"error": f"{type(exc).__name__}: {exc}"[:600]}


def run_serve(p: ServePreset, device: torch.device, deadline: Deadline, progress) -> dict:
    args = model_args(p.geometry, p.layers)
    model = random_model(args, device, torch.float16 if device.type == "cuda" else torch.float32)
    requests = lambda n, contexts: trace(p, n, contexts)  # noqa: E731 -- a fresh trace per store
    result = {"geometry": p.geometry, "layers": args.num_layers, "requests": p.requests, "contexts": p.contexts,
              "output_tokens": p.output_tokens, "arrival_rate": p.arrival_rate, "budget": p.budget, "mode": p.mode,
              "warm_format": p.warm_format, "promotions_per_boundary": p.promotions_per_boundary,
              "runs": {}, "sweep": [], "notes": [], "warmup_s": {}}
    for kind in progress([s for s in STORES if s in p.stores.split(",")], "serve stores"):
        if deadline.expired():
            result["notes"].append(f"{kind} skipped: time budget")
            continue
        if device.type == "cuda":  # kernels compile and cuBLAS picks its algorithms before the timed trace,
            began = time.perf_counter()  # as an engine warms up before it serves
            warm = dataclasses.replace(p, output_tokens=2)
            guarded(lambda: run_trace(kind, model, warm, trace(warm, 2, p.contexts[:1]), device))
            release(device)
            result["warmup_s"][kind] = time.perf_counter() - began
        with frozen_heap():  # as a serving process does once loaded (kvstore/heap.py)
            result["runs"][kind] = guarded(lambda: run_trace(kind, model, p, requests(p.requests, p.contexts),
                                                             device))
        release(device)  # the next store sizes its pools from the memory the driver reports free
    for size in progress(p.batch_sizes, "serve batch sizes"):
        if deadline.expired():
            result["notes"].append(f"batch {size} skipped: time budget")
            continue
        row = guarded(lambda: run_trace("kvtier", model, p, requests(size, p.contexts[:1]), device))
        release(device)
        result["sweep"].append({"batch": size, **row})
    base = result["runs"].get("dense-fp16")
    ours = result["runs"].get("kvtier")
    if base and ours and "error" not in base and "error" not in ours:
        result["speedup_vs_dense_fp16"] = ours["tokens_per_s"] / base["tokens_per_s"]
    if device.type != "cuda":
        result["notes"].append("CPU: decode_batch runs each sequence's token alone (the captured batch step needs "
                               "CUDA); the numbers measure the scheduler, not the batched step")
    del model
    release(device)
    return result
