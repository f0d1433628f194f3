"""Plan for the paged decode kernel: argument checks, geometry, and the split/tile config.

Kept apart from the kernels (split_walk.py, one_tile.py) so the reference and the
benchmark can share the checks and read the chosen config without launching anything.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton

from kvstore.attention.append import NewToken, check_new_token

# K elements per iteration: 128 tokens at head_dim 128, the fastest tile on the H200: bench_longctx.kernel_bench;
# BENCHMARKS.md, Paged decode kernel
_TILE_ELEMENTS = 16384
# 16-token tiles compute wrong results compiled on the H200 (triton 3.6; right in the interpreter): refused.
_MIN_TOKENS_PER_ITER = 32
_MAX_TOKENS_PER_ITER = 128  # the score tile [16, tokens] in fp32 must stay in registers too
# Programs per SM the split count aims at, as balanced_splits spreads them. Each SM runs ceil(programs /
# SMs) programs, so a count that is not a multiple of the SMs leaves a tail: at 1M (llama3-8b, batch 1, 132 SMs)
# 264 programs take 0.99 ms (fp16) and 1.14 ms (int8) where 400 take 1.28 and 1.47. The int8 loop takes the fp16
# loop's tile (a 64-token int8 tile is slower in the partition walk the decode step runs): bench_longctx.kernel_bench,
# bench_longctx.int8_bench; BENCHMARKS.md, Paged decode kernel.
PROGRAMS_PER_SM = 2
_MIN_ITERS_PER_SPLIT = 4  # below this, a split's fixed cost (q load, partial store) dominates
# The one-tile walk (one_tile.py): tokens per program (64 at head_dim 128: 95 registers at 4 warps with
# both pools, 5 programs per SM, so a 4096-token budget's 512 programs run in one wave; sm_90 compile,
# triton 3.6), and the most table tokens (summed over rows and kv heads) per SM it is chosen for: 8 kv heads
# x 16K tokens on 132 SMs; past that the split walk's loops. The fastest walk on the H200 at budget 4096, 8K
# dense and 16K int8 (29.7 us against the split walk's 34.6): bench_longctx.attention_variants; BENCHMARKS.md,
# Paged decode kernel.
_ONE_TILE_TOKENS = 64
_ONE_TILE_MAX_TOKENS_PER_SM = 1024


# The warm pool's formats (tiers/layout.py), as the kernels' WARM_FORMAT constexpr names them
WARM_INT8, WARM_FP8, WARM_INT4 = 0, 1, 2


@dataclass(frozen=True, slots=True)
class DecodeGeometry:
    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    max_blocks: int
    warm_format: int = WARM_INT8  # WARM_INT8 / WARM_FP8 / WARM_INT4, read off warm_data
    k_group: int = 0  # int4: tokens per K (scale, zero) group
    v_group: int = 0  # int4: channels per V (scale, zero) group

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """How the kernel walks the table; every field can be forced through paged_decode's kwargs.

    one_tile: one program per tile of blocks_per_iter entries (one_tile.py; num_splits = the tiles of a row,
    blocks_per_split = blocks_per_iter), else the split kernel's loops (split_walk.py).
    """

    blocks_per_iter: int
    num_splits: int
    blocks_per_split: int
    num_warps: int
    num_stages: int
    one_tile: bool = False


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_tensor(name: str, t: object, dtypes: tuple, shape: tuple, device: torch.device) -> None:
    """Shape entries of None match any size."""
    ok = isinstance(t, torch.Tensor) and t.dtype in dtypes and t.device == device and t.dim() == len(shape)
    ok = ok and all(want is None or want == got for want, got in zip(shape, t.shape))
    if not ok:
        want = "[" + ", ".join("n" if s is None else str(s) for s in shape) + "]"
        got = f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected {'/'.join(map(str, dtypes))} {want} on {device}, got {got}")


def check_decode_inputs(
    q: torch.Tensor, hot_pool: torch.Tensor, warm_data: torch.Tensor, warm_k_scale: torch.Tensor,
    warm_v_scale: torch.Tensor, block_table: torch.Tensor, block_is_int8: torch.Tensor, num_tokens: torch.Tensor,
) -> DecodeGeometry:
    """Raise ValueError unless the arguments of paged_decode agree with each other; return their geometry."""
    for name, t, rank in (("q", q, 3), ("hot_pool", hot_pool, 5), ("block_table", block_table, 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != rank:
            raise ValueError(f"{name}: expected a {rank}-d tensor, got {getattr(t, 'shape', type(t).__name__)}")
    batch, num_q_heads, head_dim = q.shape
    _, num_kv_heads, max_blocks = block_table.shape
    block_tokens = hot_pool.shape[3]
    fmt, k_group, v_group = _warm_format(warm_data, warm_k_scale, warm_v_scale, block_tokens, head_dim)
    specs = (
        ("q", q, (torch.float16,), (batch, num_q_heads, head_dim)),
        ("hot_pool", hot_pool, (torch.float16,), (None, 2, num_kv_heads, block_tokens, head_dim)),
        *_warm_specs(fmt, warm_data, warm_k_scale, warm_v_scale, num_kv_heads, block_tokens, head_dim),
        ("block_table", block_table, (torch.int32,), (batch, num_kv_heads, max_blocks)),
        ("block_is_int8", block_is_int8, (torch.bool, torch.int8), (batch, num_kv_heads, max_blocks)),
        ("num_tokens", num_tokens, (torch.int32,), (batch,)),
    )
    for name, t, dtypes, shape in specs:
        _check_tensor(name, t, dtypes, shape, q.device)
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if not (_is_pow2(head_dim) and 16 <= head_dim <= 256) or not _is_pow2(block_tokens):
        raise ValueError(f"head_dim: expected a power of two in 16..256, block_tokens: a power of two; "
                         f"got {head_dim} and {block_tokens}")
    return DecodeGeometry(batch, num_q_heads, num_kv_heads, head_dim, block_tokens, max_blocks, fmt, k_group, v_group)


def _warm_format(warm_data: torch.Tensor, warm_k_scale: torch.Tensor, warm_v_scale: torch.Tensor,
                 block_tokens: int, head_dim: int) -> tuple[int, int, int]:
    """(WARM_* code, int4's K group tokens, V group channels) of the warm pool's tensors (tiers/layout.py):
    int8 data is int8; uint8 data holds e4m3 bytes (fp8) when a row has head_dim of them, int4 codes when half."""
    if not all(isinstance(t, torch.Tensor) for t in (warm_data, warm_k_scale, warm_v_scale)):
        raise ValueError("warm_data, warm_k_scale, warm_v_scale: expected tensors")
    if warm_data.dtype != torch.uint8 or warm_data.dim() != 5:
        return WARM_INT8, 0, 0
    if warm_data.shape[-1] != head_dim // 2 or warm_k_scale.dim() != 5 or warm_v_scale.dim() != 5:
        return WARM_FP8, 0, 0
    k_groups, v_groups = max(1, warm_k_scale.shape[3]), max(1, warm_v_scale.shape[4])
    return WARM_INT4, block_tokens // k_groups, head_dim // v_groups


def _warm_specs(fmt: int, warm_data: torch.Tensor, warm_k_scale: torch.Tensor, warm_v_scale: torch.Tensor,
                heads: int, block_tokens: int, head_dim: int) -> tuple:
    """check_decode_inputs' specs of the warm pool's tensors in format `fmt`."""
    n = len(warm_data)
    if fmt == WARM_INT4:
        k_groups, v_groups = warm_k_scale.shape[3], warm_v_scale.shape[4]
        if k_groups == 0 or v_groups == 0 or block_tokens % k_groups or head_dim % v_groups:
            raise ValueError(f"warm_k_scale / warm_v_scale: int4 groups must divide {block_tokens} tokens and "
                             f"{head_dim} channels, got {k_groups} and {v_groups} groups")
        return (("warm_data", warm_data, (torch.uint8,), (None, 2, heads, block_tokens, head_dim // 2)),
                ("warm_k_scale", warm_k_scale, (torch.float16,), (n, 2, heads, k_groups, head_dim)),
                ("warm_v_scale", warm_v_scale, (torch.float16,), (n, 2, heads, block_tokens, v_groups)))
    return (("warm_data", warm_data, (torch.int8, torch.uint8), (None, 2, heads, block_tokens, head_dim)),
            ("warm_k_scale", warm_k_scale, (torch.float32,), (n, heads, head_dim)),
            ("warm_v_scale", warm_v_scale, (torch.float32,), (n, heads, block_tokens)))


def check_lse_target(lse_out: torch.Tensor | None, geom: DecodeGeometry, device: torch.device) -> None:
    """paged_decode's lse_out: None, or f32 [B, Hq] (contiguous) for the attended log-sum-exp."""
    if lse_out is None:
        return
    _check_tensor("lse_out", lse_out, (torch.float32,), (geom.batch, geom.num_q_heads), device)
    if not lse_out.is_contiguous():
        raise ValueError(f"lse_out: expected a contiguous tensor, got strides {lse_out.stride()}")


def check_append(append: NewToken | None, geom: DecodeGeometry, hot_pool: torch.Tensor) -> None:
    """paged_decode's append: None, or a NewToken (append.py) for a batch of 1 with a hot pool and the q's device."""
    if append is None:
        return
    if geom.batch != 1 or hot_pool.shape[0] == 0:
        raise ValueError(f"append: needs a batch of 1 and a hot pool, got batch {geom.batch}, "
                         f"{hot_pool.shape[0]} hot slots")
    check_new_token(hot_pool, append)
    if {t.device for t in append} != {hot_pool.device}:
        raise ValueError(f"append: expected tensors on {hot_pool.device}, got {[str(t.device) for t in append]}")


def check_mass_target(add_mass_to: tuple | None, geom: DecodeGeometry, device: torch.device) -> None:
    """paged_decode's add_mass_to: None, or (scores f32 [H, n], index int64 [H, max_blocks]) for a batch of 1."""
    if add_mass_to is None:
        return
    if geom.batch != 1:
        raise ValueError(f"add_mass_to: serves a batch of 1, got batch {geom.batch}")
    scores, index = add_mass_to
    _check_tensor("add_mass_to scores", scores, (torch.float32,), (geom.num_kv_heads, None), device)
    _check_tensor("add_mass_to index", index, (torch.int64,), (geom.num_kv_heads, geom.max_blocks), device)
    if scores.stride(-1) != 1:
        raise ValueError(f"add_mass_to scores: expected a contiguous last dim, got strides {scores.stride()}")


def check_kernel_layout(q: torch.Tensor, hot_pool: torch.Tensor, warm_data: torch.Tensor,
                        warm_k_scale: torch.Tensor, warm_v_scale: torch.Tensor) -> None:
    """What the kernel needs beyond check_decode_inputs: unit-stride rows, int8 rows in whole words, a pool."""
    for name, t in (("q", q), ("hot_pool", hot_pool), ("warm_data", warm_data), ("warm_k_scale", warm_k_scale),
                    ("warm_v_scale", warm_v_scale)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last dim (stride 1), got strides {t.stride()}")
    if warm_data.storage_offset() % 4 or any(s % 4 for s in warm_data.stride()[:-1]):
        raise ValueError(f"warm_data: expected strides and offset in whole 4-byte words, got strides "
                         f"{warm_data.stride()} and offset {warm_data.storage_offset()}")
    for name, t in (("warm_k_scale", warm_k_scale), ("warm_v_scale", warm_v_scale)):
        if t.dim() == 5 and t.shape[0] and (t.stride(0) != 2 * t.stride(1) or not t[0].is_contiguous()):
            # int4: the kernel finds a block's zero points half its slot stride after its scales
            raise ValueError(f"{name}: expected each block's int4 (scale, zero) contiguous, got strides {t.stride()}")
    if hot_pool.shape[0] == 0 and warm_data.shape[0] == 0:
        raise ValueError("hot_pool and warm_data: expected at least one pool with slots, got 0 and 0")
    if q.shape[-1] < 32 and q.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("0", ""):
        # Compiled on the H200 (triton 3.6), head_dim 16 with mixed fp16/int8 tables gave wrong results
        # (right in the interpreter and for head_dim >= 32): refused rather than served wrong.
        raise ValueError(f"head_dim: the compiled kernel needs >= 32, got {q.shape[-1]}; use paged_decode_ref")


def scale_strides(scales: torch.Tensor) -> tuple[int, int]:
    """(slot, kv head) strides of a warm scale tensor: [n, H, ...] (int8, fp8) or [n, 2, H, ...] (int4)."""
    return scales.stride(0), scales.stride(2 if scales.dim() == 5 else 1)


def use_asm(device: torch.device) -> bool:
    """Inline PTX only on a real CUDA launch; the interpreter runs the plain-Triton twin."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True")


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so tests walk the combine path
    return torch.cuda.get_device_properties(device).multi_processor_count


def one_tile_fits(geom: DecodeGeometry, device: torch.device) -> bool:
    """Whether the table is short enough for the one-tile walk (_ONE_TILE_MAX_TOKENS_PER_SM)."""
    tokens = geom.batch * geom.num_kv_heads * geom.max_blocks * geom.block_tokens
    return tokens <= _ONE_TILE_MAX_TOKENS_PER_SM * _sm_count(device)


def _tile_blocks(geom: DecodeGeometry, blocks_per_iter: int | None, tokens: int = _ONE_TILE_TOKENS) -> int:
    if blocks_per_iter is None:
        blocks_per_iter = max(1, max(_MIN_TOKENS_PER_ITER, tokens) // geom.block_tokens)
    if not _is_pow2(blocks_per_iter) or blocks_per_iter * geom.block_tokens < _MIN_TOKENS_PER_ITER:
        raise ValueError(f"blocks_per_iter: expected a power of two with >= {_MIN_TOKENS_PER_ITER} tokens per "
                         f"iteration at block_tokens={geom.block_tokens}, got {blocks_per_iter}")
    return blocks_per_iter


def _check_launch(num_warps: int, num_stages: int) -> None:
    if num_warps not in (1, 2, 4, 8, 16) or num_stages < 1:
        raise ValueError(f"num_warps: expected 1/2/4/8/16, num_stages: >= 1; got {num_warps} and {num_stages}")


def balanced_splits(rows: int, sms: int, per_sm: int, most: int) -> int:
    """Splits per row such that rows * splits programs spread evenly over the SMs: the count within
    [0.75, 1.5] x the one giving per_sm programs per SM whose busiest SM holds the least work (each SM runs
    ceil(programs / sms) programs of equal work), the nearest to it on ties; at most `most`."""
    target = per_sm * sms / rows
    lo, hi = max(1, round(0.75 * target)), max(1, min(most, round(1.5 * target)))
    if lo > hi:
        return hi
    return min(range(lo, hi + 1), key=lambda s: (-(-rows * s // sms) / (rows * s), abs(s - target)))


def decode_config(
    geom: DecodeGeometry, device: torch.device, *, num_splits: int | None = None,
    blocks_per_iter: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
    one_tile: bool | None = None,
) -> DecodeConfig:
    """one_tile None: the one-tile walk when the table is short (one_tile_fits) and num_splits is not forced.
    One tile: _ONE_TILE_TOKENS per program. Splits: ~_TILE_ELEMENTS of K per iteration; balanced_splits
    for PROGRAMS_PER_SM programs on every SM."""
    if one_tile is None:
        one_tile = num_splits is None and one_tile_fits(geom, device)
    if one_tile:
        if num_splits is not None:
            raise ValueError(f"num_splits: the one-tile walk has one split per tile, got num_splits={num_splits}")
        blocks_per_iter = _tile_blocks(geom, blocks_per_iter)
        num_warps, num_stages = num_warps or 4, num_stages or 1
        _check_launch(num_warps, num_stages)
        tiles = max(1, triton.cdiv(geom.max_blocks, blocks_per_iter))
        return DecodeConfig(blocks_per_iter, tiles, blocks_per_iter, num_warps, num_stages, one_tile=True)
    if blocks_per_iter is None:
        tokens = min(_MAX_TOKENS_PER_ITER, max(_MIN_TOKENS_PER_ITER, _TILE_ELEMENTS // geom.head_dim))
        blocks_per_iter = max(1, tokens // geom.block_tokens)
    blocks_per_iter = _tile_blocks(geom, blocks_per_iter)
    iters = max(1, triton.cdiv(geom.max_blocks, blocks_per_iter))
    if num_splits is None:
        num_splits = balanced_splits(max(1, geom.batch * geom.num_kv_heads), _sm_count(device), PROGRAMS_PER_SM,
                                     max(1, iters // _MIN_ITERS_PER_SPLIT))
    if num_splits < 1:
        raise ValueError(f"num_splits: expected >= 1, got {num_splits}")
    blocks_per_split = triton.cdiv(iters, min(num_splits, iters)) * blocks_per_iter
    num_splits = max(1, triton.cdiv(geom.max_blocks, blocks_per_split))  # no split left empty by rounding
    tile = blocks_per_iter * geom.block_tokens * geom.head_dim
    num_warps = num_warps or (8 if tile > _TILE_ELEMENTS else 4)  # 8 costs the int8 loop ~20% more issue slots
    num_stages = num_stages or 2
    _check_launch(num_warps, num_stages)
    return DecodeConfig(blocks_per_iter, num_splits, blocks_per_split, num_warps, num_stages)
