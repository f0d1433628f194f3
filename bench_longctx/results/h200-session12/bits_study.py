"""Study: rank of each needle's block under a first-level estimate with b-bit codes (truncated 4-bit) of the r
channels of largest group |q|, the other channels at their block's centre. torch, chunked; GPU when present."""
import json, math, sys, time, torch
from bench_longctx.needle import haystack
from bench_longctx.presets import NeedlePreset
from bench_longctx.sketch_bench import SPEC, SINK, RECENT, MIN_WEIGHT
from eviction.sketch import sketch_keys, unpack, grid_steps

tokens = int(sys.argv[1])
out_path = sys.argv[2]
b = 64
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
t0 = time.time()
preset = NeedlePreset(geometry="llama3-8b", contexts=(tokens,), budgets=(4096,), needles=10,
                      sink_tokens=SINK, recent_tokens=RECENT, block_tokens=b)
hay = haystack(SPEC, tokens, preset, dev, seed=tokens)
hay.pop("values")
keys = hay["keys"]
summaries, codes = sketch_keys(keys, b)
n, H, D = summaries.shape[0], SPEC.num_kv_heads, SPEC.head_dim
low, step = grid_steps(summaries)  # [n, H, D]
centre = low + step * 7.5
print("setup", time.time() - t0, flush=True)
VARIANTS = [(r, bits) for r in (32, 64, 128) for bits in (4, 3, 2)]
rows = {f"r{r}_b{bits}": [] for r, bits in VARIANTS}
CH = 1024
for i, q in enumerate(hay["queries"]):
    qf = q.float().view(H, -1, D)  # [H, G, D]
    G = qf.shape[1]
    counted = (hay["weights"][i] >= MIN_WEIGHT).view(H, G)
    nb = hay["positions"][i] // b
    imp = qf.abs().sum(1)  # [H, D]
    for r, bits in VARIANTS:
        order = imp.argsort(1, descending=True)
        read = torch.zeros(H, D, dtype=torch.bool, device=dev).scatter_(1, order[:, :r], True)
        div = 2 ** (4 - bits)
        lse = []
        for s in range(0, n, CH):
            c = unpack(codes[s:s + CH])  # [c, H, B, D] float codes 0..15
            c = torch.div(c, div, rounding_mode="floor") * div + (div - 1) / 2
            k_hat = low[s:s + CH, :, None] + step[s:s + CH, :, None] * c  # [c, H, B, D]
            k_hat = torch.where(read[None, :, None], k_hat, centre[s:s + CH, :, None])
            logit = torch.einsum("hgd,chtd->hgct", qf, k_hat) / math.sqrt(D)
            lse.append(logit.logsumexp(-1))  # [H, G, c]
        lse = torch.cat(lse, -1)  # [H, G, n]
        share = torch.softmax(lse, -1).mean(1)  # [H, n]
        share[:, :SINK // b] = 0
        share[:, -(RECENT // b + 1):] = 0
        rank = (share > share[:, nb:nb + 1]).sum(1)
        for h in range(H):
            if int(counted[h].sum()):
                rows[f"r{r}_b{bits}"].append((int(rank[h]), int(counted[h].sum())))
    print(i, round(time.time() - t0), {k: [x[0] for x in v[-3:]] for k, v in rows.items()}, flush=True)
summary = {}
for k, v in rows.items():
    summary[k] = {"trials": sum(c for _, c in v), "worst_rank": max(x[0] for x in v),
                  **{f"within_{C}": sum(c for rk, c in v if rk < C) for C in (59, 251, 507, 1019, 2043)}}
print(json.dumps(summary, indent=1))
json.dump({"tokens": tokens, "device": str(torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"),
           "summary": summary, "rows": rows}, open(out_path, "w"), indent=1)
