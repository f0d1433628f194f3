"""`kvtier demo`: a long synthetic sequence through all four tiers, read back and verified."""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from kvstore.config import Config, ModelSpec
from kvstore.store import KVStore
from tiers.quant import within_bound


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=256 * 1024, help="sequence length (default 256K)")
    parser.add_argument("--chunk", type=int, default=16 * 1024, help="tokens per append (a prefill chunk)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ssd-path", default=None, help="LMDB directory (default: a temporary one)")


def demo_config(device: str, ssd_path: str) -> Config:
    """SmolLM2-135M's attention geometry, one layer, budgets small enough that every tier fills."""
    spec = ModelSpec.preset("smollm2-135m", num_layers=1)
    return Config(model=spec, block_tokens=32, sink_tokens=64, hot_tokens=4096, warm_tokens=32768,
                  gpu_bytes=20 << 20, cpu_bytes=48 << 20, ssd_path=ssd_path, ssd_bytes=4 << 30,
                  device=device, host_memory_reserve=1 << 30)


def run(args: argparse.Namespace) -> int:
    if args.tokens <= 0 or args.chunk <= 0:
        raise SystemExit("--tokens and --chunk must be positive")
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        config = demo_config(args.device, args.ssd_path or tmp)
        with KVStore(config) as store:
            return _demo(store, args.tokens, args.chunk)


def _demo(store: KVStore, tokens: int, chunk: int) -> int:
    spec, device = store.spec, store.device
    g = torch.Generator().manual_seed(0)
    data = {layer: [torch.randn((tokens, spec.num_kv_heads, spec.head_dim), generator=g).half().to(device)
                    for _ in range(2)] for layer in range(spec.num_layers)}
    nbytes = tokens * spec.bytes_per_token
    seq = store.create_sequence()
    start = time.perf_counter()
    for first in range(0, tokens, chunk):
        for layer, (k, v) in data.items():
            store.append(seq, layer, k[first:first + chunk], v[first:first + chunk])
    append_s = time.perf_counter() - start
    stats = store.stats()
    start = time.perf_counter()
    readback = {layer: store.read(seq, layer) for layer in data}
    read_s = time.perf_counter() - start
    ok = all(within_bound(readback[layer], data[layer], store.config.block_tokens) for layer in data)
    store.check_integrity()
    print(f"kvtier demo: {tokens:,} tokens x {spec.num_layers} layers ({spec.num_kv_heads} kv heads, "
          f"head_dim {spec.head_dim}) = {nbytes / 2**20:.0f} MiB of fp16 KV on {device}")
    print(f"{'tier':<6}{'blocks':>10}{'MiB':>10}{'capacity MiB':>15}")
    for name, t in stats["tiers"].items():
        print(f"{name:<6}{t['blocks']:>10,}{t['bytes'] / 2**20:>10.1f}{t['capacity_bytes'] / 2**20:>15.1f}")
    print(f"append {nbytes / append_s / 1e9:.2f} GB/s ({tokens / append_s:,.0f} tokens/s), "
          f"read {nbytes / read_s / 1e9:.2f} GB/s")
    print(f"verify: {'OK' if ok else 'FAILED'} (fp16 tiers exact, int8 within its bound, checksums passed)")
    store.free(seq)
    store.check_integrity()
    return 0 if ok else 1
