"""Session 7 study (CPU): what quantizing the query to int8 per block would cost in attention accuracy, on real
SmolLM2-135M queries and keys (bench_longctx/real_qk.py: 8K tokens of English, 30 layers x 3 kv heads, 4 decode
steps, post-RoPE).

The candidate int8 loop (q_int8_kernel.py here) scores warm blocks on int8 tensor cores: K stays in its stored
int8 codes with KIVI's per-(block, channel) scale, which it folds into the query, q'_b = q * k_scale_b, and the
query is quantized per row and block, q8 = round(q'_b / s), s = max|q'_b| / 127, so q . k ~= s (q8 . k_int8). The
warm tier as it is (dequantized K in fp16 against the fp16 query) is the baseline. Per layer, q head and step:
the softmax of the scaled logits over the step's keys, exact (fp32 keys) vs warm (int8 K) vs candidate (int8 K and
int8 q); reported: total variation distance to the exact softmax (half the L1 distance: it bounds the output
error, |o - o_exact| <= 2 TV max|v|) and the largest logit error in nats, mean and worst over every case.

    python -m bench_longctx.real_qk --tokens 8192 --steps 4 --out /tmp/smollm2_qk.pt
    python bench_longctx/results/h200-session7/offline/q_int8_study.py /tmp/smollm2_qk.pt OUT.json
"""
import json
import sys

import torch

BLOCK_TOKENS = 64


def quantize_keys(k: torch.Tensor, block_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k f32 [T, D] -> (codes f32 [T, D] in -127..127, scale [n_blocks, D]): KIVI per (block, channel)."""
    t, d = k.shape
    n = -(-t // block_tokens)
    padded = torch.cat([k, k.new_zeros(n * block_tokens - t, d)]).view(n, block_tokens, d)
    scale = padded.abs().amax(1) / 127  # [n, D]
    codes = (padded / torch.where(scale > 0, scale, 1.0)[:, None]).round().clamp(-127, 127)
    return codes.view(-1, d)[:t], scale


def logits_three_ways(q: torch.Tensor, k: torch.Tensor, block_tokens: int,
                      group: int) -> tuple[torch.Tensor, ...]:
    """q f32 [D], k f32 [T, D] -> scaled logits [T]: exact, warm (fp16 dequantized K, fp16 q), candidate (q
    quantized per block and per `group` channels: one scale per group, a dot per group)."""
    d = q.shape[0]
    codes, scale = quantize_keys(k, block_tokens)
    blk = torch.arange(k.shape[0]) // block_tokens
    exact = k @ q
    warm = ((codes * scale[blk]).half().float() @ q.half().float())
    qs = (q[None] * scale).view(scale.shape[0], d // group, group)  # [n, G, g]: q with each block's K scale
    step = qs.abs().amax(2, keepdim=True) / 127  # [n, G, 1]
    q8 = (qs / torch.where(step > 0, step, 1.0)).round()
    cand = ((codes.view(-1, d // group, group) * q8[blk]).sum(2) * step[blk, :, 0]).sum(1)
    return tuple(x * d**-0.5 for x in (exact, warm, cand))


def main() -> None:
    data = torch.load(sys.argv[1])
    out = {}
    for group in (64, 32, 16):  # head_dim 64: 64 is one scale per row and block
        out[f"group{group}"] = study(data, group)
        print(group, json.dumps(out[f"group{group}"]["summary"]))
    json.dump(out, open(sys.argv[2], "w"))


def study(data: dict, group: int) -> dict:
    keys, queries, steps = data["keys"], data["queries"], data["steps"]
    rows = []
    for layer, (k_all, q_all) in enumerate(zip(keys, queries)):
        k_all, q_all = k_all.float(), q_all.float()  # [T, H, D], [S, Hq, D]
        per_kv = q_all.shape[1] // k_all.shape[1]
        for s in range(steps):
            n = k_all.shape[0] - steps + s + 1
            for qh in range(q_all.shape[1]):
                exact, warm, cand = logits_three_ways(q_all[s, qh], k_all[:n, qh // per_kv], BLOCK_TOKENS, group)
                p = torch.softmax(exact, 0)
                tv = {name: 0.5 * (torch.softmax(x, 0) - p).abs().sum().item() for name, x in
                      (("warm", warm), ("candidate", cand))}
                err = {name: (x - exact).abs().max().item() for name, x in (("warm", warm), ("candidate", cand))}
                rows.append(dict(layer=layer, step=s, q_head=qh, tv_warm=tv["warm"], tv_candidate=tv["candidate"],
                                 logit_err_warm=err["warm"], logit_err_candidate=err["candidate"]))
    summary = {}
    for key in ("tv_warm", "tv_candidate", "logit_err_warm", "logit_err_candidate"):
        vals = torch.tensor([r[key] for r in rows])
        summary[key] = {"mean": vals.mean().item(), "p99": vals.quantile(0.99).item(), "max": vals.max().item()}
    worst = max(rows, key=lambda r: r["tv_candidate"])
    return {"cases": len(rows), "block_tokens": BLOCK_TOKENS, "channel_group": group, "summary": summary,
            "worst": worst}


if __name__ == "__main__":
    main()
