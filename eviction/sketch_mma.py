"""The sketch selector's first level as a CUDA kernel (sketch_mma.cu), compiled at run time with NVRTC.

Same inputs and outputs as eviction/sketch_channels.py's Triton `_channel_kernel` (the read channels come from
eviction/sketch_plan.py, ascending), same error analysis: `channel_block_stats` routes here when `usable` says so.
Why a CUDA kernel: the Triton form issues ~1,160 warp-instructions per block and kv head at r = 64 (its dot takes the
decoded codes through shared memory) and takes 350 us at 1M tokens; here each lane decodes the nibbles its mma.sync
fragments hold: 170 us, most of it the copy stream (bench_longctx.sketch_bench; BENCHMARKS.md, Sketch selector).
The .cu file says how.

Used for: a CUDA device of compute capability >= 8.0 with NVRTC, head_dim 64 or 128, block_tokens 16..128,
r a multiple of 16 (<= head_dim), GQA groups of up to 8 q heads, 16-byte aligned rows.
KVTIER_SKETCH_MMA=0 turns it off; a failed compile or load warns once and leaves Triton's kernel to serve.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kvcuda import nvrtc

_SOURCE = Path(__file__).with_name("sketch_mma.cu")
_WARPS = 4
_STAGES = 2  # blocks in flight per warp, the one being read included
_PROGRAMS_PER_SM = 4  # __launch_bounds__'s minimum: <= 128 registers a thread
_HEAD_DIMS = (64, 128)
_BLOCK_TOKENS = (16, 32, 64, 128)
_MAX_GROUP = 8


class _Params(ctypes.Structure):
    """sketch_mma.cu's Params, field for field."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("s_q_head", ctypes.c_int64),
        ("summ", ctypes.c_void_p), ("s_s_blk", ctypes.c_int64), ("s_s_minmax", ctypes.c_int64),
        ("s_s_head", ctypes.c_int64),
        ("codes", ctypes.c_void_p), ("s_c_blk", ctypes.c_int64), ("s_c_head", ctypes.c_int64),
        ("channels", ctypes.c_void_p), ("s_ch_head", ctypes.c_int64),
        ("valid", ctypes.c_void_p),
        ("lse", ctypes.c_void_p), ("upper", ctypes.c_void_p), ("s_o_head", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("num_tokens", ctypes.c_int32), ("num_blocks", ctypes.c_int32), ("group", ctypes.c_int32),
    ]


def kernel_name(head_dim: int, block_tokens: int, channels: int) -> str:
    return f"sketch_first_level_d{head_dim}_t{block_tokens}_r{channels}"


def kernel_source(head_dim: int, block_tokens: int, channels: int) -> str:
    """The .cu file plus one extern "C" entry point for this geometry."""
    return _SOURCE.read_text() + (
        f'\nextern "C" __global__ void __launch_bounds__({_WARPS * 32}, {_PROGRAMS_PER_SM}) '
        f"{kernel_name(head_dim, block_tokens, channels)}(const Params p) "
        f"{{ sketch_first_level_body<{head_dim}, {block_tokens}, {channels}, {_WARPS}, {_STAGES}>(p); }}\n")


def smem_bytes(head_dim: int, block_tokens: int, channels: int) -> int:
    """Dynamic shared memory of a program: sketch_mma.cu's WARP_BYTES (the header, then per warp its ring of code
    stages, its tile buffer of min / max rows and two step buffers). Mirrors the .cu, which the host cannot read
    before a launch."""
    header = (4 * channels + 4 * (head_dim // 32) + 15) // 16 * 16
    code_stage, tile_row = channels * block_tokens // 2, 4 * head_dim + 16
    return header + _WARPS * (_STAGES * code_stage + 16 * tile_row + 8 * channels)


def compile_cubin(head_dim: int, block_tokens: int, channels: int, arch: str) -> bytes:
    """NVRTC: the kernel for this geometry as a CUBIN for arch (e.g. "sm_90"). Needs no GPU."""
    return nvrtc.compile_cubin(kernel_source(head_dim, block_tokens, channels), _SOURCE.name, arch)


@functools.lru_cache(maxsize=None)
def _function(head_dim: int, block_tokens: int, channels: int, device_index: int) -> ctypes.c_void_p:
    return nvrtc.function(kernel_source(head_dim, block_tokens, channels), _SOURCE.name,
                          kernel_name(head_dim, block_tokens, channels), device_index,
                          smem_bytes(head_dim, block_tokens, channels), "sketch_mma")


@functools.lru_cache(maxsize=None)
def _loads(head_dim: int, block_tokens: int, channels: int, device_index: int) -> bool:
    """Compiles and loads the kernel once (nvrtc.builds: a failure warns once and leaves the first level to Triton)."""
    return nvrtc.builds(lambda: _function(head_dim, block_tokens, channels, device_index), "sketch first-level kernel")


def usable(q: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor, num_channels: int) -> bool:
    """Whether channel_block_stats over these tensors (already checked by check_inputs / check_kernel_layout)
    can take the CUDA kernel."""
    if not nvrtc.device_ok(q, "KVTIER_SKETCH_MMA"):
        return False
    num_kv_heads, head_dim, block_tokens = summaries.shape[2], summaries.shape[3], codes.shape[3]
    if (head_dim not in _HEAD_DIMS or block_tokens not in _BLOCK_TOKENS or num_channels % 16
            or num_channels > head_dim or q.shape[0] // num_kv_heads > _MAX_GROUP):
        return False
    # 16-byte loads and copies: q rows, summary rows, code rows (cp.async of min(16, block_tokens / 2) bytes)
    if q.data_ptr() % 16 or q.stride(0) % 8 or summaries.data_ptr() % 16 or any(s % 8 for s in summaries.stride()[:3]):
        return False
    if codes.data_ptr() % 16 or codes.stride(0) % 16 or codes.stride(1) % 16:
        return False
    return _loads(head_dim, block_tokens, num_channels, q.device.index or 0)


def launch(q: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor, channels: torch.Tensor,
           valid: torch.Tensor | None, lse: torch.Tensor, upper: torch.Tensor, num_tokens: int,
           scale: float) -> None:
    """lse, upper float32 [Hq, N] (row-contiguous) from the read channels int32 [H, r] (the plan's); the other
    arguments as channel_block_stats has them."""
    num_blocks, _, num_kv_heads, head_dim = summaries.shape
    block_tokens, num_channels = codes.shape[3], channels.shape[1]
    func = _function(head_dim, block_tokens, num_channels, q.device.index or 0)
    p = _Params(
        q.data_ptr(), q.stride(0),
        summaries.data_ptr(), *summaries.stride()[:3],
        codes.data_ptr(), codes.stride(0), codes.stride(1),
        channels.data_ptr(), channels.stride(0),
        None if valid is None else valid.data_ptr(),
        lse.data_ptr(), upper.data_ptr(), lse.stride(0),
        scale, num_tokens, num_blocks, q.shape[0] // num_kv_heads,
    )
    # a warp per tile of 16 blocks (the kernel's tile loop also serves smaller grids, but resident programs that
    # walk several tiles are slower at 1M, 153 against 148 us: BENCHMARKS.md, Sketch selector)
    grid = ((num_blocks + 16 * _WARPS - 1) // (16 * _WARPS), num_kv_heads, 1)
    nvrtc.launch(func, grid, _WARPS * 32, smem_bytes(head_dim, block_tokens, num_channels), p, q.device)
