"""Tier bandwidths against ceilings measured in the same run.

    python -m bench_longctx.tiers_bench --out DIR [--device cuda] [--blocks 2000] [--kv-file F.pt]

Per tier and per move: hot put and decode-append rate, int8 quantize/dequantize,
cpu -> device batched fetch of scattered blocks (vs one copy call per block),
ssd write/read and zstd ratio/speed per compression mode, and the block codec alone
(encode/decode incl. checksum). `run_tiers` is what `kvtier bench tiers` calls.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import torch

from bench_longctx.timing import copy_ceiling_GBps, disk_ceiling, environment, host_device_ceilings, time_ms, timed
from kvstore.config import Config, ModelSpec
from kvstore.store import KVStore
from tiers.codec import Codec
from tiers.cpu import CpuTier
from tiers.hot import HotTier
from tiers.layout import BlockLayout
from tiers.quant import dequantize, quantize
from tiers.ssd import SsdTier


def kv_blocks(layout: BlockLayout, n: int, device: torch.device, kv_file: str | None = None) -> torch.Tensor:
    """n fp16 blocks: from a saved real KV tensor [T, H, D] pair if given, else K-like random data."""
    if kv_file:
        k, v = torch.load(kv_file)
        t = (k.shape[0] // layout.block_tokens) * layout.block_tokens
        kv = torch.stack([k[:t], v[:t]]).view(2, -1, layout.block_tokens, *k.shape[1:]).permute(1, 0, 3, 2, 4)
        reps = -(-n // kv.shape[0])
        return kv.repeat(reps, 1, 1, 1, 1)[:n].contiguous().to(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn((n, *layout.shape), generator=g)
    x[:, 0, :, :, :8] *= 12  # K's outlier channels
    return x.half().to(device)


def bench_gpu_tiers(layout: BlockLayout, x: torch.Tensor, device: torch.device) -> dict:
    n, nbytes = x.shape[0], x.numel() * 2
    hot = HotTier(layout, n * layout.fp16_bytes, device)
    ids = list(range(n))

    def put_delete() -> None:
        hot.put(ids, x)
        hot.delete(ids)

    q = quantize(x)
    return {
        "hot_put_GBps": nbytes / time_ms(put_delete, device) / 1e6,
        "int8_quantize_GBps_fp16_in": nbytes / time_ms(lambda: quantize(x), device) / 1e6,
        "int8_dequantize_GBps_fp16_out": nbytes / time_ms(lambda: dequantize(q), device) / 1e6,
    }


def bench_decode_append(spec: ModelSpec, device: torch.device, steps: int = 256) -> dict:
    """Decode-step appends (T = 1) of one layer after an 8K-token prefill: the hot path."""
    config = Config(model=spec, device=str(device), gpu_bytes=256 << 20, cpu_bytes=256 << 20, ssd_bytes=1 << 30,
                    host_memory_reserve=0)
    with KVStore(config) as store:
        seq = store.create_sequence()
        k = torch.randn(8192 + 64 + steps, spec.num_kv_heads, spec.head_dim, device=device).half()
        store.append(seq, 0, k[:8192], k[:8192])

        def decode_appends(first: int, last: int) -> None:
            for t in range(first, last):
                store.append(seq, 0, k[t:t + 1], k[t:t + 1])

        decode_appends(8192, 8192 + 64)  # warm-up: the first steps pay allocator and lazy-init costs
        _, seconds = timed(lambda: decode_appends(8192 + 64, 8192 + 64 + steps), device)
    return {"decode_append_us_per_layer": seconds / steps * 1e6}


def bench_cpu_fetch(layout: BlockLayout, x: torch.Tensor, device: torch.device, num_fetch: int) -> dict:
    """Fetch `num_fetch` scattered blocks from the cpu tier to the device in one batched call."""
    n = x.shape[0]
    cpu = CpuTier(layout, n * layout.fp16_bytes, memory_reserve=0)
    cpu.put(list(range(n)), x.cpu())
    pick = torch.randperm(n, generator=torch.Generator().manual_seed(1))[:num_fetch].tolist()
    nbytes = num_fetch * layout.fp16_bytes
    assert torch.equal(cpu.fetch(pick, device).cpu(), x.cpu()[pick]), "cpu -> device fetch returned wrong data"
    out = {"fetch_blocks": num_fetch, "fetch_bytes": nbytes,
           "cpu_fetch_batched_GBps": nbytes / time_ms(lambda: cpu.fetch(pick, device), device) / 1e6,
           "cpu_gather_verify_only_GBps": nbytes / time_ms(lambda: cpu.get(pick), device) / 1e6}
    if device.type == "cuda":
        slab, rows = cpu.slabs, [(s // cpu.slab_blocks, s % cpu.slab_blocks) for s in cpu.slots.lookup(pick)]
        dst = layout.empty_fp16(num_fetch, device)

        def per_block() -> None:  # the baseline: one copy call per block, no verification
            for i, (sl, r) in enumerate(rows):
                dst[i].copy_(slab[sl][r], non_blocking=True)

        out["cpu_fetch_per_block_copies_GBps"] = nbytes / time_ms(per_block, device) / 1e6
    cpu.close()
    return out


def bench_ssd(layout: BlockLayout, x: torch.Tensor, directory: str) -> dict:
    """Write (one LMDB transaction per put, fsync'd) and read back, per compression mode; then the same blocks
    as int8 under the default compression (quantized payloads are stored raw: tiers/codec.py). GB/s count the
    blocks' own bytes (fp16, or int8 with its scales)."""
    x = x.cpu()
    n, ids = x.shape[0], list(range(x.shape[0]))
    results = {}
    for mode, blocks in (("zstd-split", x), ("zstd", x), ("none", x), ("int8-zstd", quantize(x))):
        quantized = mode == "int8-zstd"
        parts = blocks.tensors() if quantized else (blocks,)
        nbytes = sum(t.numel() * t.element_size() for t in parts)
        path = tempfile.mkdtemp(dir=directory)
        tier = SsdTier(layout, path, 4 * nbytes + (1 << 26), compression=mode.removeprefix("int8-"), sync=True)
        rows = (lambda lo: blocks.index(slice(lo, lo + 64))) if quantized else (lambda lo: blocks[lo:lo + 64])
        _, write_s = timed(lambda: [tier.put(ids[lo:lo + 64], rows(lo)) for lo in range(0, n, 64)])
        ratio = nbytes / tier.used_bytes
        got, read_s = timed(lambda: tier.get(ids))
        assert all(torch.equal(a, b) for a, b in zip(got.tensors() if quantized else (got,), parts)), \
            f"ssd round trip failed for {mode}"
        results[mode] = {"ratio": ratio, "write_GBps": nbytes / write_s / 1e9, "read_GBps": nbytes / read_s / 1e9}
        tier.close()
        shutil.rmtree(path, ignore_errors=True)
    return results


def bench_codec(layout: BlockLayout, x: torch.Tensor) -> dict:
    """Encode and decode (checksum included) of single blocks, one thread, per compression mode."""
    x = x.cpu()
    nbytes, results = x.numel() * 2, {}
    for mode in ("zstd-split", "zstd"):
        codec = Codec(mode, level=1)
        values, encode_s = timed(lambda: [codec.encode(layout, x, row) for row in range(x.shape[0])])

        def decode_all() -> None:  # each block decoded and dropped, as a read does
            for i, value in enumerate(values):
                codec.decode(layout, value, f"block {i}")

        _, decode_s = timed(decode_all)
        results[mode] = {"ratio": nbytes / sum(len(v) for v in values), "encode_GBps": nbytes / encode_s / 1e9,
                         "decode_GBps": nbytes / decode_s / 1e9}
    return results


def run_tiers(device: torch.device, directory: str, geometry: str = "llama3-8b", blocks: int = 4096,
              fetch: int = 2000, ssd_blocks: int = 512, kv_file: str | None = None,
              ceiling_bytes: int = 1 << 30, disk_bytes: int = 256 << 20) -> dict:
    """Every tier measurement and the ceilings they are read against, all from this run."""
    spec = ModelSpec.preset(geometry, num_layers=1)
    layout = BlockLayout.of(spec, 32)
    x = kv_blocks(layout, blocks, device)
    ceilings = {"copy_GBps": copy_ceiling_GBps(device, ceiling_bytes)}
    result = {"environment": environment(device), "geometry": geometry, "block_tokens": 32,
              "block_bytes_fp16": layout.fp16_bytes, "ceilings": ceilings}
    if device.type == "cuda":
        result["ceilings"].update(host_device_ceilings(device, ceiling_bytes))
    result["ceilings"].update(disk_ceiling(directory, disk_bytes))
    result["gpu_tiers" if device.type == "cuda" else "hot_warm_on_cpu"] = bench_gpu_tiers(layout, x, device)
    result.update(bench_decode_append(spec, device))
    result["cpu_fetch"] = bench_cpu_fetch(layout, x, device, min(fetch, blocks))
    ssd_x = kv_blocks(layout, ssd_blocks, torch.device("cpu"), kv_file)
    result["ssd"] = bench_ssd(layout, ssd_x, directory)
    result["codec"] = bench_codec(layout, ssd_x)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--geometry", default="llama3-8b")
    parser.add_argument("--blocks", type=int, default=4096, help="blocks resident in the tiers")
    parser.add_argument("--fetch", type=int, default=2000, help="scattered blocks per batched fetch")
    parser.add_argument("--ssd-blocks", type=int, default=512)
    parser.add_argument("--kv-file", default=None, help="torch.save((k, v)) of real KV [T, H, D] for ssd ratios")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    os.makedirs(args.out, exist_ok=True)
    result = run_tiers(device, args.out, args.geometry, args.blocks, args.fetch, args.ssd_blocks, args.kv_file)
    name = f"tiers_{'h200' if device.type == 'cuda' else 'cpu'}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
