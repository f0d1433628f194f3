"""Session 8: the certified omitted mass at 1M tokens (llama3-8b: 32 q / 8 kv heads, 64-token blocks, 16K+ blocks,
k = 64 attended per kv head): the one-launch kernel over a knob sweep against the torch form, same process.
Prints one JSON line per setting (us by do_bench, largest difference from the torch form)."""
import json
import torch
from bench_longctx.timing import time_ms
from eviction.certify import omitted_mass_bounds_ref
from eviction.certify_kernel import omitted_mass_bounds_kernel

dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
hq, h, n, k = 32, 8, (1 << 20) // 64 + 256, 64
upper = torch.randn(hq, n, device=dev, generator=g) * 3 - 20
selected = torch.stack([torch.randperm(n, device=dev, generator=g)[:k] for _ in range(h)])
upper[torch.arange(hq, device=dev)[:, None], selected.repeat_interleave(hq // h, 0)] += 22  # the attended dominate
lse = torch.logsumexp(upper.gather(1, selected.repeat_interleave(hq // h, 0)), 1) + 0.5
want = omitted_mass_bounds_ref(upper, selected, lse)
print(json.dumps({"setting": "torch", "us": 1e3 * time_ms(lambda: omitted_mass_bounds_ref(upper, selected, lse), dev),
                  "mean_bound": float(want.mean())}), flush=True)
for chunk in (1024, 2048, 4096):
    for warps in (4, 8):
        for stages in (1, 3):
            knobs = dict(chunk=chunk, num_warps=warps, num_stages=stages)
            got = omitted_mass_bounds_kernel(upper, selected, lse, **knobs)
            us = 1e3 * time_ms(lambda: omitted_mass_bounds_kernel(upper, selected, lse, **knobs), dev)
            print(json.dumps({"setting": knobs, "us": us, "max_rel_diff": float(((got - want).abs() / want).max()),
                              "below_torch": int((got < want * (1 - 1e-6)).sum())}), flush=True)
