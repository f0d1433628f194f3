"""Where the verified int8 fetch's time goes beyond its gather kernel (session 6 diagnostic)."""
import time, torch
from bench_longctx.fetch_bench import filled_tiers
from tiers.cpu import _slot_tensor
from tiers.layout import BlockLayout

dev = torch.device("cuda")
layout = BlockLayout(8, 32, 128)
for dtype in ("float16", "int8"):
    new, old, _ = filled_tiers(layout, dtype, 4096, dev)
    picked = torch.randperm(4096, generator=torch.Generator().manual_seed(1))[:2000].tolist()
    for _ in range(3):
        new.fetch(picked, dev)
    torch.cuda.synchronize()
    rows = []
    for _ in range(10):
        t = [time.perf_counter()]
        out = new._empty(len(picked), dev); t.append(time.perf_counter())
        slots_l = new.slots.lookup(picked); t.append(time.perf_counter())
        slots = _slot_tensor(slots_l, dev); t.append(time.perf_counter())
        got = torch.zeros((len(picked), 2), dtype=torch.int64, device=dev); t.append(time.perf_counter())
        new._gather_to(slots, out, got); t.append(time.perf_counter())
        torch.cuda.synchronize(); t.append(time.perf_counter())
        new._compare(picked, got, slots); t.append(time.perf_counter())
        rows.append([1e3 * (b - a) for a, b in zip(t, t[1:])])
    med = [sorted(c)[len(c) // 2] for c in zip(*rows)]
    names = ["empty", "lookup", "slot_tensor", "zeros", "gather_launch", "gather_wait", "compare"]
    print(dtype, " ".join(f"{n}={m:.3f}ms" for n, m in zip(names, med)), "total", round(sum(med), 3))
    t0 = time.perf_counter()
    for _ in range(10):
        new.fetch(picked, dev)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 100
    nbytes = 2000 * layout.bytes_for(dtype)
    print(dtype, f"fetch wall {ms:.3f} ms = {nbytes / ms / 1e6:.1f} GB/s")
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            new.fetch(picked, dev)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8))
