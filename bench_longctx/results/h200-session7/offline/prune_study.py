"""Session 7 study (CPU): could Quest's min/max bound prune blocks before the sketch's scan, safely?

The sketch selector's first level reads codes of every block (353 us per layer at 1M, the e2e sketch path's
bottleneck). A block whose Quest upper bound on its log-sum-exp lies below tau, a lower bound on the k-th best
block's true log-sum-exp, cannot be among the oracle's top k; the certificate keeps using its Quest bound. tau:
the k-th largest sketch LOWER bound (4-bit estimate minus its error, step / 2 per channel) over a seed set read
first, the sinks, the recent window and the blocks of highest Quest bound. What fraction of blocks would the scan
then skip, on real SmolLM2-135M queries and keys (bench_longctx/real_qk.py: 8K tokens, 30 layers x 9 q heads x
4 decode steps, post-RoPE)? Per kv head the bound is the max over its group's q heads (the selection is per kv head).

    python bench_longctx/results/h200-session7/offline/prune_study.py /tmp/smollm2_qk.pt OUT.json
"""
import json
import sys

import torch

LEVELS = 15


def block_bounds(q: torch.Tensor, k: torch.Tensor, block_tokens: int) -> dict:
    """q [G, D] (a kv head's group), k [T, D] -> per block [G, N]: true lse, Quest upper, sketch lower (scaled)."""
    t, d = k.shape
    n = t // block_tokens
    k = k[: n * block_tokens].view(n, block_tokens, d)
    scale = d**-0.5
    low, high = k.amin(1), k.amax(1)  # [N, D]
    step = (high - low) / LEVELS
    codes = ((k - low[:, None]) / torch.where(step > 0, step, 1.0)[:, None]).round().clamp(0, LEVELS)
    k_hat = low[:, None] + codes * step[:, None]  # [N, B, D]
    true = torch.logsumexp(torch.einsum("gd,nbd->gnb", q, k) * scale, -1)
    est = torch.logsumexp(torch.einsum("gd,nbd->gnb", q, k_hat) * scale, -1)
    err = (q.abs() @ step.T) / 2 * scale  # [G, N]: |q . (k - k_hat)| <= sum |q_d| step_d / 2
    quest = (torch.maximum(q[:, None] * low[None], q[:, None] * high[None]).sum(-1) * scale
             + torch.log(torch.tensor(float(block_tokens))))  # [G, N]: log B + max over the box
    return {"true": true, "quest": quest, "lower": est - err}


def study(data: dict, block_tokens: int, fraction: int, seed_factor: int, sink: int, recent: int) -> dict:
    keys, queries, steps = data["keys"], data["queries"], data["steps"]
    pruned, missed, cases = [], 0, 0
    for k_all, q_all in zip(keys, queries):
        k_all, q_all = k_all.float(), q_all.float()
        heads, group = k_all.shape[1], q_all.shape[1] // k_all.shape[1]
        for s in range(steps):
            n_tok = (k_all.shape[0] - steps + s + 1) // block_tokens * block_tokens  # whole blocks
            for h in range(heads):
                b = block_bounds(q_all[s, h * group:(h + 1) * group], k_all[:n_tok, h], block_tokens)
                n = b["true"].shape[1]
                kk = max(1, n // fraction)
                quest = b["quest"].max(0).values  # [N]: per kv head, the max over its q heads
                lower = b["lower"].max(0).values  # a lower bound on the max over q heads of the true lse
                true = b["true"].max(0).values
                seeds = set(range(sink)) | set(range(n - recent, n))
                seeds |= set(quest.topk(min(n, seed_factor * kk)).indices.tolist())
                seed_lower = lower[sorted(seeds)]
                tau = seed_lower.topk(min(kk, len(seed_lower))).values[-1]
                skip = quest < tau
                oracle = set(true.topk(kk).indices.tolist())
                missed += len(oracle & set(torch.nonzero(skip).flatten().tolist()))
                pruned.append(skip.float().mean().item())
                cases += 1
    p = torch.tensor(pruned)
    return {"block_tokens": block_tokens, "budget": f"1/{fraction}", "seed_factor": seed_factor, "cases": cases,
            "pruned_mean": p.mean().item(), "pruned_p10": p.quantile(0.1).item(), "pruned_min": p.min().item(),
            "oracle_blocks_pruned": missed}


def main() -> None:
    data = torch.load(sys.argv[1])
    rows = []
    for block_tokens in (32, 64):
        for seed_factor in (1, 4):
            r = study(data, block_tokens, 16, seed_factor, sink=1, recent=2)
            print(json.dumps(r))
            rows.append(r)
    json.dump(rows, open(sys.argv[2], "w"), indent=1)


if __name__ == "__main__":
    main()
