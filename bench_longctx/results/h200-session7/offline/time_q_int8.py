"""Time q_int8_kernel.py (int8 tensor-core Q.K^T, the query quantized per block) against paged_decode's int8 loop
over a warm-only table, in the same run, with SDPA over fp16 K/V as the baseline; outputs compared. For the next
session's device time (not run yet):

    python bench_longctx/results/h200-session7/offline/time_q_int8.py --tokens 1M --out OUT.json     (CUDA)
    TRITON_INTERPRET=1 python bench_longctx/results/h200-session7/offline/time_q_int8.py --tokens 4K --heads 2 \\
        --out /tmp/q8.json                                                   (a smoke run on CPU)
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [here, os.path.join(here, "../../../..")]

from q_int8_kernel import q_int8_partials  # noqa: E402
from bench_longctx.timing import time_ms  # noqa: E402
from kvstore.attention.paged_decode import paged_decode  # noqa: E402


def parse_tokens(text: str) -> int:
    return int(text[:-1]) * (1 << 20 if text.endswith("M") else 1 << 10) if text[-1] in "KM" else int(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1M")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--splits", type=int, default=33)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    n_tok, h, d, t = parse_tokens(a.tokens), a.heads, a.head_dim, a.block_tokens
    blocks = n_tok // t
    q = torch.randn((h * a.group, d), device=dev).half()
    warm = torch.randint(-127, 128, (blocks, 2, h, t, d), dtype=torch.int8, device=dev)
    k_scale = torch.rand((blocks, h, d), device=dev) * 0.02 + 0.005
    v_scale = torch.rand((blocks, h, t), device=dev) * 0.02 + 0.005
    table = torch.randperm(blocks, device=dev).int()[None].expand(h, blocks).contiguous()
    num_tokens = torch.tensor([n_tok], dtype=torch.int32, device=dev)
    hot = torch.empty((0, 2, h, t, d), dtype=torch.float16, device=dev)
    flags = torch.ones((1, h, blocks), dtype=torch.bool, device=dev)
    use_asm = dev.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"

    def candidate():
        o_part, lse_part, _ = q_int8_partials(q, warm, k_scale, v_scale, table, num_tokens, a.splits, use_asm)
        w = torch.softmax(lse_part * math.log(2), -1).nan_to_num(0.0)  # the merge, in torch (not timed apart)
        return (w[..., None] * o_part).sum(1)

    def current():
        return paged_decode(q[None], hot, warm, k_scale, v_scale, table[None], flags, num_tokens,
                            return_block_mass=True)[0][0]

    got, ref = candidate().float(), current().float()
    result = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "tokens": n_tok,
              "block_tokens": t, "splits": a.splits, "max_abs_diff_vs_paged_decode": (got - ref).abs().max().item(),
              "q_int8_ms": time_ms(candidate, dev), "paged_decode_int8_ms": time_ms(current, dev)}
    if dev.type == "cuda":
        k = torch.randn((1, h, n_tok, d), dtype=torch.float16, device=dev)
        v = torch.randn_like(k)
        result["sdpa_fp16_ms"] = time_ms(lambda: F.scaled_dot_product_attention(q[None, :, None], k, v,
                                                                                  enable_gqa=True), dev)
    print(json.dumps(result))
    json.dump(result, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
