"""Verified cpu -> GPU fetch of scattered blocks: 2,000 of 4,096 blocks in pinned cpu-tier slabs, fp16
(128 KiB at 8 kv heads x 32 tokens x 128) and int8 (data + KIVI scales). Per format, GB/s of block bytes:

    gather_kernel        gather_rows alone, from one pinned [4096, block words] tensor (the transfer itself)
    slab_kernel          gather_slab_rows from the same tensor (a one-slab table), no sums
    slab_summed_kernel   the same, summing each block on the way: what summing costs the transfer
    tier_gather          the tier's gather: every slab and field in one launch, no sums
    tier_summed_gather   the same launch summing each block on the way (the fused fetch's one kernel)
    block_sums           checksums of the gathered rows in device memory: the second read that fusing saves
    check                block_sums + comparison with the recorded sums, one host sync
    verified_fetch       fetch(ids, cuda) with block sums: the summed gather, then the comparison on the
                         GPU, one host sync (fused)
    unfused_verified_fetch  the same fetch unfused: the tier's gather, then block_sums over the gathered
                         rows, then the comparison (what fusing the sums into the gather saves)
    verified_fetch_wall  verified_fetch by the host's clock over 20 back-to-back calls (what a caller waits)
    host_verified_fetch  the host-checked fetch (checksums="host"): xxh3 of the stored rows on 4 worker threads
                         while the GPU gathers
    get / host_get       get(ids) into pinned host memory: rows copied on the host, then checked on the GPU / by xxh3
    put_from_gpu         put of GPU blocks (summed on the GPU, copied to the host), 512 at a time, into a fresh
                         tier (the puts grow it: new pinned slabs)
    put_from_gpu_steady  the last 512 deleted and put again, into slabs that exist (median of 3)

and one big pinned H2D copy of the same bytes as the ceiling. Results are checked (the fused, unfused and
host-verified fetches agree; the summed gather's sums are block_sums' and the recorded ones; a flipped bit
in a pinned row makes the verified fetch raise) before they are written.

    python -m bench_longctx.fetch_bench --out FILE.json   (CUDA; ~1 minute)
    python -m bench_longctx.fetch_bench --blocks 24 --of 48 --heads 2 --tokens 16 --head-dim 32 \
        --out /tmp/fetch_cpu.json   (a smoke run on CPU: block sums on the CPU, no ceiling)

Numbers: BENCHMARKS.md, Tiers.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench_longctx.timing import environment, host_device_ceilings, time_ms, timed
from tiers.base import IntegrityError, device_ints
from tiers.block_checksum import block_sums
from tiers.cpu import CpuTier
from tiers.fetch_kernel import gather_rows, gather_slab_rows, slab_table
from tiers.layout import BlockLayout, QuantBlocks
from tiers.quant import quantize

_PUT_BATCH = 512


def filled_tiers(layout: BlockLayout, dtype: str, num_blocks: int,
                 device: torch.device) -> tuple[CpuTier, CpuTier, float, float]:
    """(block-sum tier, xxh3 tier, seconds the block-sum tier took to put every block from `device`, the median
    seconds of putting the last batch again after deleting it: slabs already there)."""
    capacity = num_blocks * layout.bytes_for(dtype)
    new = CpuTier(layout, capacity, dtype, memory_reserve=0, checksums=str(device))
    old = CpuTier(layout, capacity, dtype, memory_reserve=0, checksums="host")
    g = torch.Generator(device).manual_seed(0)
    put_s = 0.0
    for lo in range(0, num_blocks, _PUT_BATCH):
        ids = list(range(lo, min(lo + _PUT_BATCH, num_blocks)))
        x = torch.randn((len(ids), *layout.shape), generator=g, device=device).half()
        part = x if dtype == "float16" else quantize(x)
        put_s += timed(lambda: new.put(ids, part), device)[1]
        old.put(ids, part)
    again = []
    for _ in range(3):
        new.delete(ids)
        again.append(timed(lambda: new.put(ids, part), device)[1])
    return new, old, put_s, sorted(again)[1] * num_blocks / len(ids)


def unfused_fetch(tier: CpuTier, ids: list[int], device: torch.device):
    """fetch(ids, device) without the fused sums: gather, then block_sums over the gathered rows, then compare."""
    out = tier._empty(len(ids), device)
    slots = device_ints(tier.slots.lookup(ids), device)
    tier._gather_to(slots, out)
    tier._check(ids, out, slots)
    return out


def wall_GBps(fn, nbytes: int, device: torch.device, calls: int = 20) -> float:
    """GB/s of `calls` back-to-back calls by the host's clock, as a caller waiting on each one sees them (the
    fetch syncs: it returns verified blocks). The do_bench figures time each call between CUDA events, after
    a cache flush queued before it."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return round(calls * nbytes / (time.perf_counter() - start) / 1e9, 2)


def same(a, b) -> bool:
    pairs = zip(a.tensors(), b.tensors()) if isinstance(a, QuantBlocks) else [(a, b)]
    return all(torch.equal(x, y) for x, y in pairs)


def run_format(layout: BlockLayout, dtype: str, num_blocks: int, picked: list[int], device: torch.device) -> dict:
    new, old, put_s, steady_s = filled_tiers(layout, dtype, num_blocks, device)
    block_bytes = layout.bytes_for(dtype)
    nbytes = len(picked) * block_bytes

    def gbps(fn) -> float:
        return round(nbytes / time_ms(fn, device) / 1e6, 2)

    slots = device_ints(new.slots.lookup(picked), device)
    out = new._empty(len(picked), device)
    fields = out.tensors() if isinstance(out, QuantBlocks) else (out,)
    sums = torch.zeros((len(picked), 2), dtype=torch.int64, device=device)  # [n, 2]
    new._gather_to(slots, out, sums)
    words = torch.ones((num_blocks, block_bytes // 4), dtype=torch.int32, pin_memory=device.type == "cuda")
    one_slab = slab_table([[words]], device)
    rows = torch.tensor(picked, dtype=torch.int64, device=device)
    flat = torch.empty((len(picked), words.shape[1]), dtype=torch.int32, device=device)
    flat_sums = torch.zeros_like(sums)
    result = {
        "block_bytes": block_bytes,
        "gather_kernel_GBps": gbps(lambda: gather_rows(words, rows, flat)),
        "slab_kernel_GBps": gbps(lambda: gather_slab_rows(one_slab, rows, [flat])),
        "slab_summed_kernel_GBps": gbps(lambda: gather_slab_rows(one_slab, rows, [flat], flat_sums.zero_())),
        "tier_gather_GBps": gbps(lambda: new._gather_to(slots, out)),
        "tier_summed_gather_GBps": gbps(lambda: new._gather_to(slots, out, sums.zero_())),
        "block_sums_GBps": gbps(lambda: block_sums(fields)),
        "check_GBps": gbps(lambda: new._check(picked, out, slots)),
        "verified_fetch_GBps": gbps(lambda: new.fetch(picked, device)),
        "unfused_verified_fetch_GBps": gbps(lambda: unfused_fetch(new, picked, device)),
        "host_verified_fetch_GBps": gbps(lambda: old.fetch(picked, device)),
        "get_GBps": gbps(lambda: new.get(picked)),
        "host_get_GBps": gbps(lambda: old.get(picked)),
        "put_from_gpu_GBps": round(num_blocks * block_bytes / put_s / 1e9, 2),
        "put_from_gpu_steady_GBps": round(num_blocks * block_bytes / steady_s / 1e9, 2),
        "verified_fetch_wall_GBps": wall_GBps(lambda: new.fetch(picked, device), nbytes, device),
    }
    fused = new.fetch(picked, device)
    if not (same(fused, old.fetch(picked, device)) and same(fused, unfused_fetch(new, picked, device))):
        raise AssertionError(f"{dtype}: the fused, unfused and host-verified fetches disagree")
    new._gather_to(slots, out, sums.zero_())
    if not (torch.equal(sums, block_sums(fields)) and torch.equal(sums, new.sums[slots])):
        raise AssertionError(f"{dtype}: the summed gather's sums differ from block_sums' or the recorded ones")
    slot = new.slots.lookup(picked[:1])[0]
    slab = new.slabs[slot // new.slab_blocks]
    row = (slab if dtype == "float16" else slab.data)[slot % new.slab_blocks].view(-1).view(torch.uint8)
    row[12345 % row.numel()] ^= 1  # one bit of a pinned row, in place
    for name, fetch in (("", new.fetch), ("unfused_", lambda ids, device: unfused_fetch(new, ids, device))):
        try:
            fetch(picked, device)
        except IntegrityError:
            result[f"{name}flipped_bit_caught"] = True
        else:
            raise AssertionError(f"{dtype}: a flipped bit in a pinned row was served ({name}fetch)")
    new.close()
    old.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=2000, help="blocks fetched")
    parser.add_argument("--of", type=int, default=4096, help="blocks stored")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--out", required=True, help="JSON results")
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    layout = BlockLayout(args.heads, args.tokens, args.head_dim)
    picked = torch.randperm(args.of, generator=torch.Generator().manual_seed(1))[:args.blocks].tolist()
    report = {"env": environment(device), "blocks": args.blocks, "of": args.of, "layout": list(layout.shape)}
    for dtype in ("float16", "int8"):
        report[dtype] = run_format(layout, dtype, args.of, picked, device)
        print(dtype, json.dumps(report[dtype]), flush=True)
    if device.type == "cuda":
        ceiling = host_device_ceilings(device, args.blocks * layout.fp16_bytes)["pinned_h2d_GBps"]
        report["one_big_pinned_h2d_GBps"] = round(ceiling, 2)
        print("one big pinned H2D", report["one_big_pinned_h2d_GBps"], "GB/s")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
