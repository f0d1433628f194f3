"""The int8 pool's split walk as a CUDA kernel (int8_mma.cu), compiled at run time with NVRTC.

Why a CUDA kernel beside the Triton ones: the int8 loop needs its bytes decoded into tensor-core
operand registers, and Triton routes every decoded tile through shared memory as fp16 (int8 read
that way is slower than fp16 at 1M tokens). The .cu file says how the fragments are laid out.

It serves warm-only launches of `split_partials` (a table of int8 blocks, or the int8 half of a
partitioned mixed table) and writes exactly what Triton's `_split_kernel` writes there, so the merge
is shared. Used when `usable` says so: a CUDA device of compute capability >= 8.0, NVRTC and the
driver library found (every CUDA build of PyTorch ships libnvrtc), head_dim 64 or 128, block_tokens
16..128, GQA groups of up to 8 q heads, 16-byte aligned rows with a block's tokens head_dim bytes apart,
a positive score scale; KVTIER_INT8_MMA=0 turns it off.
Everything else takes the Triton kernel. NVRTC needs no CUDA toolkit; the CUBIN is cached on disk
(~/.cache/kvtier/int8_mma, or $KVTIER_CACHE_DIR) keyed by the source, the options and the GPU.

Launches go through the driver's cuLaunchKernel on PyTorch's current stream, so they are captured
into CUDA graphs like any other launch; the partition walk's (after its fp16 launch) is programmatic
on sm_90 (nvrtc.launch), and every launch asks for enough shared memory to hold an SM to
plan.PROGRAMS_PER_SM programs (launch_smem). The first `usable` check per geometry compiles (or reads
the cache) and loads the module: like Triton's first launch, it belongs before a capture, not inside one.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kvcuda import nvrtc
from kvstore.attention.plan import PROGRAMS_PER_SM, DecodeConfig, DecodeGeometry

_SOURCE = Path(__file__).with_name("int8_mma.cu")
# 4 warps a program, 2 stages (chunks in flight per warp, the one being read included): 90% of the copy ceiling's
# rate at 1M tokens on the H200, where 6 warps or 3 stages are no faster: bench_longctx.int8_bench; BENCHMARKS.md,
# Int8 kernels
_WARPS = 4
_STAGES = 2  # 2 x 4 warps x 8.8 KB at head_dim 128: room for 3 programs per SM
# __launch_bounds__'s minimum blocks: registers for 3 programs an SM (<= 168 a thread). How many an SM holds at
# once is plan.PROGRAMS_PER_SM, what the grid is sized for, capped by the shared memory a launch asks (launch_smem):
# a launch that starts while another kernel's programs still run (the partition walk's programmatic int8 launch)
# would otherwise pack 3 on some SMs and leave others idle (sinks + recent at 1M: 0.73 ms against 0.58;
# bench_longctx.int8_bench; BENCHMARKS.md, Int8 kernels)
_MIN_BLOCKS = 3
_HEAD_DIMS = (64, 128)
_BLOCK_TOKENS = (16, 32, 64, 128)
_MAX_GROUP = 8


class _Params(ctypes.Structure):
    """int8_mma.cu's Params, field for field."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("s_q_batch", ctypes.c_int64), ("s_q_head", ctypes.c_int64),
        ("warm", ctypes.c_void_p), ("s_w_slot", ctypes.c_int64), ("s_w_kv", ctypes.c_int64),
        ("s_w_head", ctypes.c_int64),
        ("k_scale", ctypes.c_void_p), ("s_ks_slot", ctypes.c_int64), ("s_ks_head", ctypes.c_int64),
        ("v_scale", ctypes.c_void_p), ("s_vs_slot", ctypes.c_int64), ("s_vs_head", ctypes.c_int64),
        ("table", ctypes.c_void_p), ("pos", ctypes.c_void_p),
        ("s_tab_batch", ctypes.c_int64), ("s_tab_head", ctypes.c_int64), ("s_tab_blk", ctypes.c_int64),
        ("num_tokens", ctypes.c_void_p),
        ("num_fp16", ctypes.c_void_p), ("s_nf_batch", ctypes.c_int64), ("s_nf_head", ctypes.c_int64),
        ("o_part", ctypes.c_void_p), ("lse_part", ctypes.c_void_p), ("lse_block", ctypes.c_void_p),
        ("qk_scale", ctypes.c_float),
        ("blocks_per_split", ctypes.c_int32), ("pool_splits", ctypes.c_int32), ("split_base", ctypes.c_int32),
        ("num_splits", ctypes.c_int32), ("max_blocks", ctypes.c_int32), ("num_q_heads", ctypes.c_int32),
        ("group", ctypes.c_int32), ("blocks_per_iter", ctypes.c_int32),
        ("partitioned", ctypes.c_int32), ("return_mass", ctypes.c_int32),
    ]


def kernel_name(head_dim: int, block_tokens: int) -> str:
    return f"int8_split_d{head_dim}_t{block_tokens}"


def kernel_source(head_dim: int, block_tokens: int) -> str:
    """The .cu file plus one extern "C" entry point for this geometry."""
    return _SOURCE.read_text() + (
        f'\nextern "C" __global__ void __launch_bounds__({_WARPS * 32}, {_MIN_BLOCKS}) '
        f"{kernel_name(head_dim, block_tokens)}(const Params p) "
        f"{{ int8_split_body<{head_dim}, {block_tokens}, {_WARPS}, {_STAGES}>(p); }}\n")


def smem_bytes(head_dim: int, block_tokens: int) -> int:
    """Dynamic shared memory of a program: int8_mma.cu's Geometry (its chunks' stages), or the combine's
    partials if larger."""
    chunk = min(block_tokens, 32)
    stage = 2 * chunk * head_dim + 4 * head_dim + 4 * chunk + 16
    return max(_WARPS * _STAGES * stage, 4 * _WARPS * (16 + 8 * head_dim))


@functools.lru_cache(maxsize=None)
def launch_smem(head_dim: int, block_tokens: int, device_index: int) -> int:
    """The dynamic shared memory a launch asks for: smem_bytes, or more, so that no more than PROGRAMS_PER_SM
    programs fit on one of the device's SMs."""
    per_sm = nvrtc.device_attribute(device_index, nvrtc.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)
    reserved = nvrtc.device_attribute(device_index, nvrtc.CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK)
    return max(smem_bytes(head_dim, block_tokens), per_sm // (PROGRAMS_PER_SM + 1) - reserved + 1)


def compile_cubin(head_dim: int, block_tokens: int, arch: str) -> bytes:
    """NVRTC: the kernel for this geometry as a CUBIN for arch (e.g. "sm_90"). Needs no GPU."""
    return nvrtc.compile_cubin(kernel_source(head_dim, block_tokens), _SOURCE.name, arch)


@functools.lru_cache(maxsize=None)
def _function(head_dim: int, block_tokens: int, device_index: int) -> ctypes.c_void_p:
    return nvrtc.function(kernel_source(head_dim, block_tokens), _SOURCE.name, kernel_name(head_dim, block_tokens),
                          device_index, launch_smem(head_dim, block_tokens, device_index), "int8_mma")


def usable(q: torch.Tensor, warm_data: torch.Tensor, warm_k_scale: torch.Tensor, warm_v_scale: torch.Tensor,
           table: torch.Tensor, geom: DecodeGeometry, scale: float) -> bool:
    """Whether a warm-only split launch over these tensors can take the CUDA kernel (scale: the log2-domain
    score scale; the kernel takes the max of unscaled scores, so it must be positive)."""
    if not nvrtc.device_ok(q, "KVTIER_INT8_MMA") or not scale > 0:
        return False
    if (geom.head_dim not in _HEAD_DIMS or geom.block_tokens not in _BLOCK_TOKENS or geom.group > _MAX_GROUP
            or table.dtype != torch.int32):
        return False
    # cp.async copies 16-byte pieces: of K / V rows (a block's tokens D bytes apart), K's and V's scale rows
    if (warm_data.data_ptr() % 16 or any(s % 16 for s in warm_data.stride()[:-1])
            or warm_data.stride()[3:] != (geom.head_dim, 1)):
        return False
    if warm_k_scale.data_ptr() % 16 or any(s % 4 for s in warm_k_scale.stride()[:-1]):
        return False
    if warm_v_scale.data_ptr() % 16 or any(s % 4 for s in warm_v_scale.stride()[:-1]):
        return False
    if q.data_ptr() % 4 or any(s % 2 for s in q.stride()[:-1]):  # q is read two fp16 at a time
        return False
    return _loads(geom.head_dim, geom.block_tokens, q.device.index or 0)


@functools.lru_cache(maxsize=None)
def _loads(head_dim: int, block_tokens: int, device_index: int) -> bool:
    """Compiles and loads the kernel once (nvrtc.builds: a failure warns once and leaves the launches to Triton)."""
    return nvrtc.builds(lambda: _function(head_dim, block_tokens, device_index), "int8 decode kernel")


def launch(q: torch.Tensor, warm_data: torch.Tensor, warm_k_scale: torch.Tensor, warm_v_scale: torch.Tensor,
           table: torch.Tensor, positions: torch.Tensor, num_tokens: torch.Tensor, num_fp16: torch.Tensor,
           o_part: torch.Tensor, lse_part: torch.Tensor, lse_block: torch.Tensor, geom: DecodeGeometry,
           cfg: DecodeConfig, scale: float, *, partitioned: bool, split_base: int, grid_splits: int,
           total_splits: int, return_mass: bool, programmatic: bool = False) -> None:
    """One warm-only launch: grid (batch, kv heads, grid_splits), split = split_base + its index; arguments as
    split_partials has them (warm_data int8, as paged_decode checked it). programmatic: right after the fp16
    launch of the same partition walk, overlapping its last programs (nvrtc.launch says when that is allowed)."""
    func = _function(geom.head_dim, geom.block_tokens, q.device.index or 0)
    p = _Params(
        q.data_ptr(), q.stride(0), q.stride(1),
        warm_data.data_ptr(), *warm_data.stride()[:3],
        warm_k_scale.data_ptr(), warm_k_scale.stride(0), warm_k_scale.stride(1),
        warm_v_scale.data_ptr(), warm_v_scale.stride(0), warm_v_scale.stride(1),
        table.data_ptr(), positions.data_ptr(), *table.stride(),
        num_tokens.data_ptr(), num_fp16.data_ptr(), *num_fp16.stride(),
        o_part.data_ptr(), lse_part.data_ptr(), lse_block.data_ptr(),
        scale, cfg.blocks_per_split, cfg.num_splits, split_base, total_splits, geom.max_blocks, geom.num_q_heads,
        geom.group, cfg.blocks_per_iter, int(partitioned), int(return_mass),
    )
    nvrtc.launch(func, (geom.batch, geom.num_kv_heads, grid_splits), _WARPS * 32,
                 launch_smem(geom.head_dim, geom.block_tokens, q.device.index or 0), p, q.device,
                 programmatic=programmatic)
