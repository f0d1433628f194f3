"""The contexts benchmarks' store and data (contexts_bench.py, open_profile.py): the Config of a run, a context of
random K/V with its token ids recorded, and a count of the bytes the saved contexts' reader returns.
"""

from __future__ import annotations

import argparse
import copy

import torch

from bench_longctx.contexts_tokens import BUDGET
from kvstore.config import Config, ModelSpec
from kvstore.store import KVStore

BLOCK_TOKENS = 32
CHUNK = 8192
VOCAB = 32000


def preset_defaults(args: argparse.Namespace, presets: dict[str, dict]) -> argparse.Namespace:
    """args with each option left unset (None) taken from presets[args.preset]."""
    for name, value in presets[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def bench_config(args: argparse.Namespace, path: str) -> Config:
    spec = ModelSpec.preset(args.geometry, num_layers=args.layers)
    return Config(model=spec, block_tokens=BLOCK_TOKENS, hot_tokens=1024, warm_tokens=args.warm_tokens,
                  gpu_bytes=args.gpu_bytes, staging_tokens=BUDGET,  # a staging row per selected block: the
                  # captured step reads the cpu tier's blocks itself (fewer rows: every token goes the eager way)
                  cpu_bytes=args.cpu_bytes, cpu_dtype="int8", ssd_path=path, ssd_bytes=args.ssd_bytes,
                  ssd_compression="none", device=args.device, host_memory_reserve=0, model_id="contexts-bench")


def fill(store: KVStore, context: int) -> tuple[int, list[int]]:
    spec, g = store.spec, torch.Generator(device=store.device).manual_seed(0)
    seq = store.create_sequence()
    ids = torch.randint(0, VOCAB, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    store.extend_tokens(seq, ids)
    for layer in range(spec.num_layers):
        for lo in range(0, context, CHUNK):
            n = min(CHUNK, context - lo)
            k = torch.randn((n, spec.num_kv_heads, spec.head_dim), generator=g, device=store.device)
            k[..., :8] *= 6  # outlier channels, as real keys have
            store.append(seq, layer, k.half(), torch.randn(k.shape, generator=g, device=store.device).half())
    return seq, ids


def counting_reads(store: KVStore) -> list[int]:
    """Bytes each read of the saved contexts' reader returns (manifests, summaries, H2O scores, token ids, sketch
    codes; not blocks, which the saved tier reads), copied (get) or in place (view), appended to the list handed
    back."""
    sizes, values = [], copy.copy(store.saved.reader.values)  # a copy: the saved tier reads through the original
    get, view = values.get, values.view

    def counted(got: list) -> list:
        sizes.extend(len(v) for v in got if v is not None)
        return got

    values.get = lambda keys: counted(get(keys))
    values.view = lambda keys, use: view(keys, lambda got: use(counted(got)))
    store.saved.reader.values = values
    return sizes
