"""Session 6 diagnostic: the dense step per layer (a token of all 32 llama3-8b layers in one graph) at 8K-32K under
variants of the dense table's bucket, the one-tile walk's tile and the merge's split chunk (patched in place)."""
import json, sys, torch
import torch.nn.functional as F
from bench_longctx.latency import token_step_per_layer_ms
from bench_longctx.presets import get_preset
from bench_longctx.timing import time_ms
from kvstore.attention import plan, merge
from kvstore.step import DecodeStep

dev = torch.device("cuda")
p = get_preset("h200").decode
base_bucket = DecodeStep._dense_bucket
base_tile = plan._tile_blocks.__defaults__


def quarter_bucket(self, num_tokens):
    """The next multiple of a quarter of the power of two below the blocks held (>= 16), at most capacity."""
    blocks = -(-num_tokens // self.block_tokens)
    q = max(4, (1 << (blocks - 1).bit_length()) // 4)
    return min(self.capacity, max(16, -(-blocks // q) * q))


variants = {
    "base": {},
    "merge_chunk_128": {"chunk": 128},
    "tile_128": {"tile": 128},
    "quarter_bucket": {"bucket": quarter_bucket},
    "quarter_bucket+chunk_128": {"bucket": quarter_bucket, "chunk": 128},
    "tile_128+quarter_bucket": {"tile": 128, "bucket": quarter_bucket},
}
rows = []
for ctx in (8192, 16384, 32768):
    k = torch.randn((1, 8, ctx, 128), device=dev).half()
    q = torch.randn((1, 32, 1, 128), device=dev).half()
    sdpa = time_ms(lambda: F.scaled_dot_product_attention(q, k, k, enable_gqa=True), dev)
    del k
    for name, v in variants.items():
        DecodeStep._dense_bucket = v.get("bucket", base_bucket)
        plan._tile_blocks.__defaults__ = (v["tile"],) if "tile" in v else base_tile
        merge._MAX_SPLIT_CHUNK = v.get("chunk", 64)
        ms = token_step_per_layer_ms("llama3-8b", ctx, p, dev, "dense", 0)
        rows.append({"context": ctx, "variant": name, "ms_per_layer": ms, "sdpa_ms": sdpa, "time_vs_sdpa": ms / sdpa})
        print(json.dumps(rows[-1]), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
