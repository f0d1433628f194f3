"""Contexts as objects: what fork shares and what opening a saved context costs.

    python -m bench_longctx.contexts_bench [--contexts 8K,32K,128K] [--layers 4] [--out FILE]

Per context length (random K/V of a named geometry, token ids recorded, the store's default
windows: hot and warm on the "GPU" pools, the rest in cpu and ssd):
  forks        blocks stored for one sequence and for it plus 10 forks (references vs stored)
  save         seconds and bytes of store.save (every block, summaries, sketches, token ids)
  open         in a fresh store on the same ssd_path (a new process sees the same work): seconds of
               store.open, then of the first attend in every layer per mode and how many cold blocks
               it read, beside the same attend on the never-saved sequence in the writer's store.
               Lazy means: open stays flat as the context grows (summaries and sketches only) and an
               opened sequence's first sparse attend reads only what it selects; dense reads all
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

from bench_longctx.presets import parse_tokens
from bench_longctx.timing import environment, timed
from kvstore.config import Config, ModelSpec
from kvstore.store import KVStore

BLOCK_TOKENS = 32
CHUNK = 8192


def bench_config(spec: ModelSpec, path: str) -> Config:
    return Config(model=spec, block_tokens=BLOCK_TOKENS, hot_tokens=1024, warm_tokens=2048, gpu_bytes=256 << 20,
                  cpu_bytes=256 << 20, ssd_path=path, ssd_bytes=16 << 30, device="cpu", model_id="contexts-bench")


def fill(store: KVStore, context: int) -> int:
    spec, g = store.spec, torch.Generator().manual_seed(0)
    seq = store.create_sequence()
    store.extend_tokens(seq, torch.randint(0, 50000, (context,), generator=g).tolist())
    for layer in range(spec.num_layers):
        for lo in range(0, context, CHUNK):
            n = min(CHUNK, context - lo)
            k = torch.randn((n, spec.num_kv_heads, spec.head_dim), generator=g)
            k[..., :8] *= 6  # outlier channels, as real keys have
            store.append(seq, layer, k.half(), torch.randn(k.shape, generator=g).half())
    return seq


MODES = ("topk", "sketch", "dense")  # topk: min/max summaries (Quest); sketch: the 4-bit key sketch (eviction/)


def first_attends(store: KVStore, seq: int) -> dict:
    q = torch.randn((store.spec.num_q_heads, store.spec.head_dim), generator=torch.Generator().manual_seed(1)).half()
    out = {}
    for mode in MODES:
        before = store.stats()["attend"]["cold_blocks_fetched"]
        _, seconds = timed(lambda: [store.attend(seq, layer, q, mode, budget=2048)
                                    for layer in range(store.spec.num_layers)])
        out[mode] = {"s": seconds, "blocks_read": store.stats()["attend"]["cold_blocks_fetched"] - before}
    return out


def run_context(spec: ModelSpec, context: int, directory: str) -> dict:
    path = str(Path(directory) / f"ctx-{context}")
    with KVStore(bench_config(spec, path)) as store:
        seq = fill(store, context)
        alone = store.stats()["blocks"]
        forks = [store.fork(seq) for _ in range(10)]
        shared = store.stats()["blocks"]
        for f in forks:
            store.free(f)
        _, save_s = timed(lambda: store.save(seq, "bench"))
        saved_bytes = sum(len(v) for v in store.saved.encoded(
            [b for layer in range(spec.num_layers) for b in store.table(seq, layer).block_ids]))
        never_saved = first_attends(store, seq)
    with KVStore(bench_config(spec, path)) as store:  # what a new process does: nothing cached in the store
        opened, open_s = timed(lambda: store.open("bench"))
        loaded = store.stats()["blocks"]["stored"] - store.stats()["tiers"]["saved"]["blocks"]
        attends = first_attends(store, opened)
    shutil.rmtree(path, ignore_errors=True)
    return {"context": context, "blocks_per_layer": -(-context // BLOCK_TOKENS),
            "one_sequence": alone, "with_10_forks": shared,
            "fork_blocks_ratio": shared["stored"] / alone["stored"],
            "save_s": save_s, "saved_block_bytes": saved_bytes, "open_s": open_s, "blocks_loaded_at_open": loaded,
            "first_attend": attends, "first_attend_never_saved": never_saved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", default="smollm2-135m")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--contexts", default="8K,32K,128K")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    spec = ModelSpec.preset(args.geometry, num_layers=args.layers)
    directory = tempfile.mkdtemp(prefix="kvtier-contexts-")
    try:
        rows = [run_context(spec, parse_tokens(c), directory) for c in args.contexts.split(",")]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    result = {"geometry": args.geometry, "layers": args.layers, "block_tokens": BLOCK_TOKENS,
              "environment": environment(torch.device("cpu")), "rows": rows}
    for r in rows:
        attends = ", ".join(f"{m} {r['first_attend'][m]['s'] * 1e3:.0f} ms / {r['first_attend'][m]['blocks_read']} "
                            f"blocks (never saved: {r['first_attend_never_saved'][m]['s'] * 1e3:.0f} ms)" for m in MODES)
        print(f"{r['context']:>8} tokens: 10 forks hold {r['fork_blocks_ratio']:.3f}x the blocks; save "
              f"{r['save_s']:.2f} s; open {r['open_s'] * 1e3:.0f} ms ({r['blocks_loaded_at_open']} blocks loaded); "
              f"first attend, all layers: {attends}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
