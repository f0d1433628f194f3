"""cpu -> GPU fetch pieces on their own: the zero-copy gather kernel, checksum verification on 1 and 16
threads, the whole verified fetch, and one contiguous pinned H2D copy as the ceiling.

    python -m bench_longctx.fetch_bench    (CUDA; results of the 2026-11-29 H200 run: results/fetch_h200.txt)
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from bench_longctx.timing import host_device_ceilings, time_ms
from tiers.base import checksum
from tiers.cpu import CpuTier
from tiers.fetch_kernel import gather_rows
from tiers.layout import BlockLayout


def main() -> None:
    L = BlockLayout(8, 32, 128)
    n = 4096
    x = torch.randn((n, *L.shape)).half()
    cpu = CpuTier(L, n * L.fp16_bytes, memory_reserve=0)
    cpu.put(list(range(n)), x)
    pick = torch.randperm(n)[:2000].tolist()
    slots = cpu.slots.lookup(pick)
    slab = cpu.slabs[0]
    print("slabs", len(cpu.slabs), "pinned", slab.is_pinned())
    nbytes = 2000 * L.fp16_bytes

    def t(name, fn):
        print(name, round(nbytes / time_ms(fn, "cuda") / 1e6, 2), "GB/s")

    rows = torch.tensor([s % cpu.slab_blocks for s in slots], device="cuda")
    words = slab.view(slab.shape[0], -1).view(torch.int32)
    dst = torch.empty((2000, words.shape[1]), dtype=torch.int32, device="cuda")
    t("gather_rows kernel", lambda: gather_rows(words, rows, dst))
    pool = ThreadPoolExecutor(16)

    def verify_all():
        list(pool.map(lambda s: checksum([slab[s % cpu.slab_blocks]]), slots))

    t("verify 16 threads", verify_all)
    t("verify 1 thread", lambda: [checksum([slab[s % cpu.slab_blocks]]) for s in slots])
    t("fetch", lambda: cpu.fetch(pick, "cuda"))
    print("one big H2D", round(host_device_ceilings(torch.device("cuda"), nbytes)["pinned_h2d_GBps"], 2), "GB/s")


if __name__ == "__main__":
    main()
