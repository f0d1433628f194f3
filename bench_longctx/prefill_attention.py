"""Which SDPA backend the layer-wise prefill should use for a chunk of queries over a long prefix (CUDA).

    python -m bench_longctx.prefill_attention --out DIR [--contexts 131072,1048576] [--chunk 8192]

engine_adapter.llama.chunk_attention runs each prefill chunk (`chunk` queries at the end of `context`
keys, lower-right causal, GQA) through F.scaled_dot_product_attention. This times that call per
backend torch offers on the device (flash, cuDNN, memory-efficient; cuDNN and efficient also with the
K/V heads expanded to the query heads, for builds where they refuse GQA), checks each output against
the default's, and reports TFLOP/s next to the device's measured dense matmul rate, the prefill's
FLOP-bound ceiling (bench_longctx/e2e.py).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from bench_longctx.e2e_setup import matmul_flops_per_s
from bench_longctx.timing import environment, time_ms, write_json

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # llama3-8b


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: SDPBackend | None,
              expand: bool) -> torch.Tensor:
    t, s = q.shape[2], k.shape[2]
    if expand:
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    mask = causal_lower_right(t, s)
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=not expand)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=not expand)


def run_context(context: int, chunk: int, device: torch.device) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn((1, HEADS, chunk, HEAD_DIM), generator=g, device=device, dtype=torch.float16)
    k = torch.randn((1, KV_HEADS, context, HEAD_DIM), generator=g, device=device, dtype=torch.float16)
    v = torch.randn_like(k)
    pairs = chunk * (context - chunk) + chunk * (chunk + 1) / 2  # the last chunk: causal within it
    flops = 4.0 * HEADS * HEAD_DIM * pairs
    want = attention(q, k, v, None, False)
    rows = []
    for name, backend, expand in (("default", None, False), ("flash", SDPBackend.FLASH_ATTENTION, False),
                                  ("cudnn", SDPBackend.CUDNN_ATTENTION, False),
                                  ("cudnn_expanded", SDPBackend.CUDNN_ATTENTION, True),
                                  ("efficient", SDPBackend.EFFICIENT_ATTENTION, False),
                                  ("efficient_expanded", SDPBackend.EFFICIENT_ATTENTION, True)):
        row = {"context": context, "chunk": chunk, "backend": name}
        try:
            got = attention(q, k, v, backend, expand)
            ms = time_ms(lambda: attention(q, k, v, backend, expand), device)
            row.update(ms=ms, tflops=flops / ms / 1e9, max_abs_diff=float((got.float() - want.float()).abs().max()))
        except RuntimeError as e:  # this backend refuses these inputs on this build
            row["error"] = str(e).splitlines()[0][:200]
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--contexts", default="131072,1048576")
    parser.add_argument("--chunk", type=int, default=8192)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    rows = [r for c in args.contexts.split(",") for r in run_context(int(c), args.chunk, device)]
    write_json(args.out, "prefill_attention.json", {"environment": environment(device), "rows": rows,
                                                    "matmul_tflops": matmul_flops_per_s(device, torch.float16) / 1e12})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
