"""Study (CPU): rank of each needle's block under the first level's ranking estimate, 4-bit codes of the r channels
of largest group |q|, the unread channels at their block's box centre (what ships) or at their block's mean key
(a candidate summary: D more fp16 per block and kv head). Same haystack and counting as results/h200-session12's
bits_study.py. KV_HEADS (default 8, llama3-8b's) below 8 keeps the group of 4 and the blocks per head (what a needle
competes with) and fits 1M tokens into a CPU's memory; SEED (default TOKENS) draws another haystack.
Usage: python unread_study.py TOKENS OUT.json [R,R,...] [centre,mean] [KV_HEADS] [SEED]"""
import json, math, sys, time, torch
from bench_longctx.needle import haystack
from bench_longctx.presets import NeedlePreset
from bench_longctx.sketch_bench import SPEC, SINK, RECENT, MIN_WEIGHT
from kvstore.config import ModelSpec
from eviction.sketch import sketch_keys, unpack, grid_steps

tokens, out_path = int(sys.argv[1]), sys.argv[2]
R_LIST = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "32,40,48,56,64").split(",")]
U_LIST = (sys.argv[4] if len(sys.argv) > 4 else "centre,mean").split(",")
KV_HEADS = int(sys.argv[5]) if len(sys.argv) > 5 else SPEC.num_kv_heads
SEED = int(sys.argv[6]) if len(sys.argv) > 6 else tokens
SPEC = ModelSpec.preset("llama3-8b", num_layers=1, num_kv_heads=KV_HEADS, num_q_heads=4 * KV_HEADS)
b, dev, t0 = 64, torch.device("cpu"), time.time()
preset = NeedlePreset(geometry="llama3-8b", contexts=(tokens,), budgets=(4096,), needles=10,
                      sink_tokens=SINK, recent_tokens=RECENT, block_tokens=b)
hay = haystack(SPEC, tokens, preset, dev, seed=SEED)
keys = hay["keys"]
summaries, codes = sketch_keys(keys, b)
n, H, D = summaries.shape[0], SPEC.num_kv_heads, SPEC.head_dim
low, step = grid_steps(summaries)  # [n, H, D]
fill = {"centre": low + step * 7.5, "mean": keys.float().view(n, b, H, D).mean(1).half().float()}
print("setup", round(time.time() - t0), flush=True)
VARIANTS = [(r, u) for r in R_LIST for u in U_LIST]
rows = {f"r{r}_{u}": [] for r, u in VARIANTS}
CH = 512
for i, q in enumerate(hay["queries"]):
    qf = q.float().view(H, -1, D)  # [H, G, D]
    counted = (hay["weights"][i] >= MIN_WEIGHT).view(H, -1)
    nb = hay["positions"][i] // b
    order = qf.abs().sum(1).argsort(1, descending=True)  # [H, D]
    lse = {k: [] for k in rows}
    for s in range(0, n, CH):
        k_hat = low[s:s + CH, :, None] + step[s:s + CH, :, None] * unpack(codes[s:s + CH])  # [c, H, B, D]
        for r, u in VARIANTS:
            read = torch.zeros(H, D, dtype=torch.bool).scatter_(1, order[:, :r], True)
            qr, qu = qf * read[:, None], qf * ~read[:, None]
            logit = (torch.einsum("hgd,chtd->hgct", qr, k_hat)
                     + torch.einsum("hgd,chd->hgc", qu, fill[u][s:s + CH])[..., None]) / math.sqrt(D)
            lse[f"r{r}_{u}"].append(logit.logsumexp(-1))  # [H, G, c]
    for key, parts in lse.items():
        share = torch.softmax(torch.cat(parts, -1), -1).mean(1)  # [H, n]
        share[:, :SINK // b] = 0
        share[:, -(RECENT // b + 1):] = 0
        rank = (share > share[:, nb:nb + 1]).sum(1)
        rows[key] += [(int(rank[h]), int(counted[h].sum())) for h in range(H) if int(counted[h].sum())]
    print(i, round(time.time() - t0), {k: max(x[0] for x in v) for k, v in rows.items()}, flush=True)
summary = {k: {"trials": sum(c for _, c in v), "worst_rank": max(x[0] for x in v),
               **{f"within_{C}": sum(c for rk, c in v if rk < C) for C in (59, 251, 507, 1019)}}
           for k, v in rows.items()}
print(json.dumps(summary, indent=1))
json.dump({"tokens": tokens, "kv_heads": KV_HEADS, "seed": SEED, "device": "cpu", "summary": summary, "rows": rows}, open(out_path, "w"), indent=1)
