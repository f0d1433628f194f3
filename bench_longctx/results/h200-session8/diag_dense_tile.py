"""Session 8 diagnosis: the dense decode step per layer (every layer of llama3-8b in one graph replay, as
`kvtier bench decode` reports kvtier_dense_graphed_per_layer) at 8K-16K for one-tile sizes of 64 and 128 tokens,
against SDPA in the same process. Prints one JSON line per case."""
import json
import torch
from bench_longctx import latency
from bench_longctx.presets import get_preset
from kvstore.attention import plan
from kvstore.config import ModelSpec

dev = torch.device("cuda")
p = get_preset("h200").decode
spec = ModelSpec.preset(p.geometry, num_layers=1)
for ctx in (8192, 16384):
    q = torch.randn((spec.num_q_heads, spec.head_dim), device=dev).half()
    sdpa = latency.sdpa_ms(spec, ctx, q, 200)
    for tokens in (64, 128):
        plan._ONE_TILE_TOKENS = tokens
        ms = latency.token_step_per_layer_ms(p.geometry, ctx, p, dev, "dense", 0)
        print(json.dumps({"context": ctx, "one_tile_tokens": tokens, "dense_per_layer_us": ms * 1e3,
                          "sdpa_us": sdpa * 1e3, "ratio_to_sdpa": ms / sdpa}), flush=True)
