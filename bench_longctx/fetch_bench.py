"""Verified cpu -> GPU fetch of scattered blocks (issue 10): 2,000 of 4,096 blocks in pinned cpu-tier slabs, fp16
(128 KiB at 8 kv heads x 32 tokens x 128) and int8 (data + KIVI scales). Per format, GB/s of block bytes:

    gather_kernel        gather_rows alone, from one pinned [4096, block words] tensor (the transfer itself)
    tier_gather          the tier's gather: one launch per slab and field, rows scattered to batch positions
    block_sums           checksums of the gathered rows in device memory (one launch)
    verified_fetch       fetch(ids, cuda) with block sums: gather, then check on the GPU, one host sync
    host_verified_fetch  the old fetch: xxh3 of the stored rows on 4 worker threads while the GPU gathers
    get / host_get       get(ids) into pinned host memory: rows copied on the host, then checked on the GPU / by xxh3
    put_from_gpu         put of GPU blocks (summed on the GPU, copied to the host), 512 at a time

and one big pinned H2D copy of the same bytes as the ceiling. Results are checked (new and old fetches
agree; a flipped bit in a pinned row makes the verified fetch raise) before they are written.

    python -m bench_longctx.fetch_bench --out bench_longctx/results/fetch_h200.json   (CUDA; ~1 minute)
    python -m bench_longctx.fetch_bench --blocks 24 --of 48 --heads 2 --tokens 16 --head-dim 32 \
        --out /tmp/fetch_cpu.json   (a smoke run on CPU: block sums on the CPU, no ceiling)

Earlier runs: results/fetch_h200.txt.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench_longctx.timing import environment, host_device_ceilings, time_ms, timed
from tiers.base import IntegrityError
from tiers.block_checksum import block_sums
from tiers.cpu import CpuTier
from tiers.fetch_kernel import gather_rows
from tiers.layout import BlockLayout, Int8Blocks
from tiers.quant import quantize

_PUT_BATCH = 512


def filled_tiers(layout: BlockLayout, dtype: str, num_blocks: int,
                 device: torch.device) -> tuple[CpuTier, CpuTier, float]:
    """(block-sum tier, xxh3 tier, seconds the block-sum tier took to put every block from `device`)."""
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
    return new, old, put_s


def same(a, b) -> bool:
    pairs = zip(a.tensors(), b.tensors()) if isinstance(a, Int8Blocks) else [(a, b)]
    return all(torch.equal(x, y) for x, y in pairs)


def run_format(layout: BlockLayout, dtype: str, num_blocks: int, picked: list[int], device: torch.device) -> dict:
    new, old, put_s = filled_tiers(layout, dtype, num_blocks, device)
    block_bytes = layout.bytes_for(dtype)
    nbytes = len(picked) * block_bytes

    def gbps(fn) -> float:
        return round(nbytes / time_ms(fn, device) / 1e6, 2)

    slots = new.slots.lookup(picked)
    out = new._empty(len(picked), device)
    fields = out.tensors() if isinstance(out, Int8Blocks) else (out,)
    slots_on_device = new._gather_to(slots, out)
    words = torch.ones((num_blocks, block_bytes // 4), dtype=torch.int32, pin_memory=device.type == "cuda")
    rows = torch.tensor(picked, dtype=torch.int64, device=device)
    flat = torch.empty((len(picked), words.shape[1]), dtype=torch.int32, device=device)
    result = {
        "block_bytes": block_bytes,
        "gather_kernel_GBps": gbps(lambda: gather_rows(words, rows, flat)),
        "tier_gather_GBps": gbps(lambda: new._gather_to(slots, out)),
        "block_sums_GBps": gbps(lambda: block_sums(fields)),
        "check_GBps": gbps(lambda: new._check(picked, out, slots_on_device)),
        "verified_fetch_GBps": gbps(lambda: new.fetch(picked, device)),
        "host_verified_fetch_GBps": gbps(lambda: old.fetch(picked, device)),
        "get_GBps": gbps(lambda: new.get(picked)),
        "host_get_GBps": gbps(lambda: old.get(picked)),
        "put_from_gpu_GBps": round(num_blocks * block_bytes / put_s / 1e9, 2),
    }
    if not same(new.fetch(picked, device), old.fetch(picked, device)):
        raise AssertionError(f"{dtype}: the verified fetch and the host-verified fetch disagree")
    slot = slots[0]
    slab = new.slabs[slot // new.slab_blocks]
    row = (slab if dtype == "float16" else slab.data)[slot % new.slab_blocks].view(-1).view(torch.uint8)
    row[12345 % row.numel()] ^= 1  # one bit of a pinned row, in place
    try:
        new.fetch(picked, device)
    except IntegrityError:
        result["flipped_bit_caught"] = True
    else:
        raise AssertionError(f"{dtype}: a flipped bit in a pinned row was served")
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
