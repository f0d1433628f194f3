"""Model geometry and store configuration: the one place every knob lives."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import psutil
import torch

from tiers.layout import QUANT_FORMATS

_TOKENS_MAX = 1 << 40  # windows, in tokens: far past any context, far below overflow
_BYTES_MAX = 1 << 50  # byte budgets: 1 PiB (LMDB's map size and host allocators overflow beyond)
_INT_FIELDS = (  # (field, lowest, highest) of every integer knob of Config
    ("block_tokens", 1, 1 << 16), ("sink_tokens", 0, _TOKENS_MAX), ("hot_tokens", 1, _TOKENS_MAX),
    ("warm_tokens", 0, _TOKENS_MAX), ("recent_tokens", 0, _TOKENS_MAX), ("staging_tokens", 0, _TOKENS_MAX),
    ("hot_sequences", 1, 1 << 20), ("promotions_per_boundary", 0, 1 << 20),
    ("gpu_bytes", 0, _BYTES_MAX), ("cpu_bytes", 0, _BYTES_MAX), ("ssd_bytes", 0, _BYTES_MAX),
    ("ssd_level", -7, 22), ("host_memory_reserve", 0, _BYTES_MAX),
)


def is_int(value: object) -> bool:
    """An int, not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


_PRESETS: dict[str, dict[str, int]] = {
    # Geometries from the models' published configs.
    "llama3-8b": dict(num_layers=32, num_q_heads=32, num_kv_heads=8, head_dim=128),
    "llama3-70b": dict(num_layers=80, num_q_heads=64, num_kv_heads=8, head_dim=128),
    "qwen2.5-7b": dict(num_layers=28, num_q_heads=28, num_kv_heads=4, head_dim=128),
    "smollm2-135m": dict(num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64),
}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The attention geometry of a decoder: what one token's KV cache looks like."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not is_int(value) or not 0 < value <= 1 << 20:
                raise ValueError(f"ModelSpec.{name} must be an int in [1, {1 << 20}], got {value!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.dtype != torch.float16:
            raise ValueError(f"ModelSpec.dtype must be torch.float16, got {self.dtype}")

    @staticmethod
    def preset(name: str, **overrides: int) -> ModelSpec:
        """A named geometry (`ModelSpec.presets()` lists them); overrides replace fields, e.g. num_layers=2."""
        if name not in _PRESETS:
            raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(_PRESETS)}")
        return ModelSpec(**{**_PRESETS[name], **overrides})

    @staticmethod
    def presets() -> list[str]:
        return sorted(_PRESETS)

    @property
    def gqa_group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def bytes_per_token(self) -> int:
        """fp16 K and V of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2


@dataclass(slots=True)
class Config:
    """Everything a KVStore needs. Windows are per sequence and layer; byte budgets are shared."""

    model: ModelSpec
    block_tokens: int = 32
    sink_tokens: int = 64  # first tokens of every sequence, always hot (attention sinks)
    hot_tokens: int = 4096  # most recent tokens, kept fp16 on the GPU
    warm_tokens: int = 32768  # the next most recent, kept quantized (warm_format) on the GPU
    hot_sequences: int = 1  # sequences whose sinks + hot window + tail the hot pool holds at once (a batch's size)
    warm_format: str = "int8"  # "int8", "fp8" (e4m3) or "int4" (KIVI, 2 codes a byte): docs/tiers.md, Formats
    int4_group: int = 32  # int4: tokens of K (per channel) and channels of V (per token) sharing a scale and zero
    recent_tokens: int | None = None  # window every sparse step keeps, at most 1/8 of its budget (None: min(1024, hot_tokens))
    gpu_bytes: int = 1 << 30  # hot + warm pools + staging, shared by all sequences
    staging_tokens: int | None = None  # GPU slots (fp16 and warm each) cold blocks are fetched into per step (None: hot_tokens)
    cpu_bytes: int = 4 << 30  # cold host tier
    # "float16" (exact for blocks that reach it from the hot tier), warm_format (blocks cool as the warm tier holds
    # them), or "auto": float16 beside an int8 or fp8 warm tier (their blocks quantize back to the same bytes),
    # int4 beside an int4 one (a block's int4 bytes do not always survive dequantize + quantize: docs/tiers.md)
    cpu_dtype: str = "auto"
    cpu_checksums: str = "auto"  # "auto": block sums on the GPU beside pinned slabs (what a captured step verifies
    # cpu blocks with), else xxh3 on the host; "host"; or a device ("cpu": block sums in torch, slow: tests)
    promotions_per_boundary: int = 512  # cpu blocks a captured decode step reads again and again that move up to
    # the warm tier at one block boundary, at most (kvstore/blocks/promotion.py; the eager path: this / num_layers
    # a call; 0: none): bounds that host work
    ssd_path: str | None = None  # None: a temporary directory removed on close()
    ssd_bytes: int = 64 << 30
    ssd_compression: str = "zstd"  # "zstd", "zstd-split" (byte planes first) or "none"; BENCHMARKS.md: ratios
    ssd_level: int = 1  # zstd level, -7 (fastest) to 22
    remote_url: str | None = None  # a `kvtier serve` sidecar; cold blocks go there instead of local ssd
    remote_token: str | None = None
    redis_url: str | None = None  # redis://, rediss:// or unix:// of a Redis/Valkey node or any cluster node:
    # cold blocks go there instead of local ssd, up to ssd_bytes (docs/redis.md)
    redis_namespace: str | None = None  # this store's key prefix (None: kvtier:<random>); one per store
    redis_compression: str = "none"  # "none" or "zstd": 1.08x smaller values, slower gets (BENCHMARKS.md)
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    host_memory_reserve: int = 2 << 30  # never let host tiers push free RAM below this
    eager_graphs: bool = True  # on CUDA, store.attend replays each layer of a decode token's step as a CUDA graph
    # (kvstore/decode/layer_graphs.py; False: its kernels launched one by one)
    sketch_codes: bool = True  # 4-bit key codes per block for mode="sketch": device memory of 1/8 of the fp16 K/V
    # (1/4 of int8); False leaves them out (more sequences fit) and refuses mode="sketch"
    model_id: str = ""  # the weights' identity (e.g. a checkpoint name): blocks are content-keyed and saved
    # contexts opened only under the same model_id and geometry (kvstore/contexts/sequences.py); saving or opening through
    # Redis, where content-keyed blocks are shared between stores, needs one (kvstore/contexts/opening.py)

    def __post_init__(self) -> None:
        for name in ("sketch_codes", "eager_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Config.{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.model, ModelSpec):
            raise ValueError(f"Config.model must be a ModelSpec, got {type(self.model).__name__}")
        if self.recent_tokens is None:
            self.recent_tokens = min(1024, self.hot_tokens) if is_int(self.hot_tokens) else self.hot_tokens
        if self.staging_tokens is None:
            self.staging_tokens = self.hot_tokens
        if self.cpu_dtype == "auto":
            self.cpu_dtype = "int4" if self.warm_format == "int4" else "float16"
        for name, low, high in _INT_FIELDS:
            value = getattr(self, name)
            if not is_int(value) or not low <= value <= high:
                raise ValueError(f"Config.{name} must be an int in [{low}, {high}], got {value!r}")
        if self.block_tokens & (self.block_tokens - 1):
            raise ValueError(f"Config.block_tokens must be a power of two, got {self.block_tokens}")
        if self.hot_tokens < self.block_tokens:
            raise ValueError(
                f"hot_tokens ({self.hot_tokens}) must cover at least one block ({self.block_tokens} tokens)"
            )
        self._check_formats()
        if self.ssd_compression not in ("zstd-split", "zstd", "none"):
            raise ValueError(f"ssd_compression must be 'zstd-split', 'zstd' or 'none', got {self.ssd_compression!r}")
        if not isinstance(self.cpu_checksums, str):
            raise ValueError(f"Config.cpu_checksums must be a str, got {self.cpu_checksums!r}")
        for name in ("ssd_path", "remote_url", "remote_token", "redis_url", "redis_namespace"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"Config.{name} must be a str or None, got {getattr(self, name)!r}")
        if not isinstance(self.model_id, str) or len(self.model_id) > 1024:
            raise ValueError(f"Config.model_id must be a str of at most 1024 characters, got {self.model_id!r}")
        self._check_redis()
        self._check_device()

    def _check_formats(self) -> None:
        if self.warm_format not in QUANT_FORMATS:
            raise ValueError(f"Config.warm_format must be one of {QUANT_FORMATS}, got {self.warm_format!r}")
        if not is_int(self.int4_group) or self.int4_group < 2 or self.int4_group & (self.int4_group - 1):
            raise ValueError(f"Config.int4_group must be a power of two >= 2, got {self.int4_group!r}")
        head_dim = self.model.head_dim
        if self.warm_format == "int4" and (head_dim % 2 or head_dim % min(self.int4_group, head_dim)):
            raise ValueError(f"warm_format='int4' needs an even head_dim that int4_group ({self.int4_group}) "
                             f"divides or exceeds, got head_dim {self.model.head_dim}")
        if self.cpu_dtype not in ("float16", self.warm_format):
            raise ValueError(f"cpu_dtype must be 'auto', 'float16' or the warm_format {self.warm_format!r}, "
                             f"got {self.cpu_dtype!r}")

    def _check_redis(self) -> None:
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"Config.redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
        if self.redis_url and self.remote_url:
            raise ValueError("Config.redis_url and Config.remote_url both name a cold tier; set one")
        if self.redis_namespace is not None:
            if not self.redis_url:
                raise ValueError("Config.redis_namespace needs Config.redis_url")
            if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,200}", self.redis_namespace):  # tiers/redis.py's rule
                raise ValueError(f"Config.redis_namespace must match [A-Za-z0-9_.:-]{{1,200}}, got {self.redis_namespace!r}")
        if self.redis_compression not in ("none", "zstd"):
            raise ValueError(f"Config.redis_compression must be 'none' or 'zstd', got {self.redis_compression!r}")

    def _check_device(self) -> None:
        if not isinstance(self.device, str):
            raise ValueError(f"Config.device must be a torch device string, got {self.device!r}")
        try:
            device = torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(f"Config.device must be a torch device string, got {self.device!r}") from exc
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"Config.device is {self.device!r} but CUDA is not available; use device='cpu'")
        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" \
            else psutil.virtual_memory().total
        if self.gpu_bytes > total:  # on CPU the "GPU" pools are host memory
            raise ValueError(f"Config.gpu_bytes={self.gpu_bytes} exceeds the {total} bytes {self.device} has")

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)
