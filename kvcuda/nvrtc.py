"""Compile CUDA C++ with NVRTC, cache the CUBIN on disk, load it through the driver, launch on torch's stream.

`compile_cubin` needs no GPU. `function` compiles (or reads ~/.cache/kvtier/<cache>/, or $KVTIER_CACHE_DIR)
and loads a kernel once per (source, kernel, device); launches through cuLaunchKernel on PyTorch's current
stream are captured into CUDA graphs like any other launch. A first `function` call belongs before a capture,
as Triton's first launch does. Every kernel source may `#include "kvcuda/device.cuh"`.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

_HEADER = Path(__file__).with_name("device.cuh")
HEADER_NAME = "kvcuda/device.cuh"
_OPTIONS = ("-std=c++17", "--use_fast_math", "-default-device")
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def _find_library(names: list[str], dirs: list[str]) -> ctypes.CDLL | None:
    for name in names:
        for d in dirs + [""]:
            try:
                return ctypes.CDLL(os.path.join(d, name) if d else name)
            except OSError:
                continue
    return None


@functools.lru_cache(maxsize=None)
def nvrtc_library() -> ctypes.CDLL | None:
    """libnvrtc: beside PyTorch's CUDA libraries (the nvidia-* wheels, or torch/lib), else the loader's path."""
    import site

    roots = [os.path.dirname(torch.__file__)] + site.getsitepackages()
    dirs = [os.path.join(os.path.dirname(torch.__file__), "lib")]
    for root in roots:
        dirs += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib")))
        dirs += sorted(glob.glob(os.path.join(root, "nvidia", "cu*", "lib")))
    names = []
    for d in dirs:
        names += [os.path.basename(p) for p in sorted(glob.glob(os.path.join(d, "libnvrtc.so*")))
                  if "builtins" not in p and ".alt." not in p]
    names = list(dict.fromkeys(names + ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]))
    return _find_library(names, dirs)


@functools.lru_cache(maxsize=None)
def driver_library() -> ctypes.CDLL | None:
    return _find_library(["libcuda.so.1", "libcuda.so"], [])


def available() -> bool:
    """NVRTC and the CUDA driver library are both found."""
    return nvrtc_library() is not None and driver_library() is not None


def device_ok(x: torch.Tensor, switch: str) -> bool:
    """Whether a kernel may serve tensor x: its environment switch is not 0 / false, x is on a CUDA device of compute
    capability >= 8.0, and NVRTC and the driver library are found."""
    if os.environ.get(switch, "1") in ("0", "false", "False"):
        return False
    return x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 0) and available()


def builds(build: Callable[[], object], what: str) -> bool:
    """Runs build() (a compile and load); a failure (an NVRTC too old for the GPU, say) warns and returns False, so
    the caller's launches go to Triton instead of failing. Callers cache the answer per geometry: one warning."""
    try:
        build()
        return True
    except (RuntimeError, OSError, AttributeError) as err:
        warnings.warn(f"kvtier: the CUDA {what} is unavailable, Triton's serves instead: {err}", RuntimeWarning,
                      stacklevel=3)
        return False


def _check_nvrtc(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"NVRTC {what}: {lib.nvrtcGetErrorString(rc).decode()}")


def check_driver(rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        driver_library().cuGetErrorString(rc, ctypes.byref(msg))
        raise RuntimeError(f"CUDA driver {what}: {(msg.value or b'?').decode()}")


def compile_cubin(source: str, filename: str, arch: str) -> bytes:
    """NVRTC: source (which may include kvcuda/device.cuh) as a CUBIN for arch, e.g. "sm_90". Needs no GPU."""
    lib = nvrtc_library()
    if lib is None:
        raise RuntimeError("NVRTC not found (libnvrtc ships with PyTorch's CUDA builds)")
    prog = ctypes.c_void_p()
    headers = (ctypes.c_char_p * 1)(_HEADER.read_text().encode())
    names = (ctypes.c_char_p * 1)(HEADER_NAME.encode())
    _check_nvrtc(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), filename.encode(), 1, headers,
                                             names), "create")
    opts = [f"--gpu-architecture={arch}".encode()] + [o.encode() for o in _OPTIONS]
    try:
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        if rc != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC compile of {filename} failed:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _check_nvrtc(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        _check_nvrtc(lib, lib.nvrtcGetCUBIN(prog, cubin), "cubin")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def cache_dir(cache: str) -> Path:
    return Path(os.environ.get("KVTIER_CACHE_DIR", Path.home() / ".cache" / "kvtier")) / cache


def cubin(source: str, filename: str, kernel: str, arch: str, cache: str) -> bytes:
    """compile_cubin, through the disk cache (keyed by the source, the shared header, the options and arch)."""
    key = hashlib.sha256(f"{source}|{_HEADER.read_text()}|{_OPTIONS}|{arch}|v2".encode()).hexdigest()[:24]
    path = cache_dir(cache) / f"{kernel}_{arch}_{key}.cubin"
    if path.exists():
        return path.read_bytes()
    data = compile_cubin(source, filename, arch)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    except OSError as err:  # a read-only home still gets the kernel, compiled again by every process
        warnings.warn(f"kvtier: cannot cache the CUDA kernel {kernel} in {path.parent} ({err}); set "
                      f"KVTIER_CACHE_DIR to a writable folder to compile it once", RuntimeWarning, stacklevel=2)
    return data


def function(source: str, filename: str, kernel: str, device_index: int, smem_bytes: int,
             cache: str) -> ctypes.c_void_p:
    """The loaded kernel (callers cache it per geometry and device); allows smem_bytes of dynamic shared memory."""
    major, minor = torch.cuda.get_device_capability(device_index)
    data = cubin(source, filename, kernel, f"sm_{major}{minor}", cache)
    cuda = driver_library()
    with torch.cuda.device(device_index):  # makes the device's primary context current on this thread
        module, func = ctypes.c_void_p(), ctypes.c_void_p()
        check_driver(cuda.cuModuleLoadData(ctypes.byref(module), data), "module load")
        check_driver(cuda.cuModuleGetFunction(ctypes.byref(func), module, kernel.encode()), "get function")
        check_driver(cuda.cuFuncSetAttribute(func, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes),
                     "shared memory limit")
    return func


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, then a 64-byte union (8-byte aligned) of which the ids used here read an int."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


@functools.lru_cache(maxsize=None)
def _driver_version() -> int:
    version = ctypes.c_int()
    check_driver(driver_library().cuDriverGetVersion(ctypes.byref(version)), "driver version")
    return version.value


def programmatic_launch_ok(device: torch.device) -> bool:
    """Whether launches on device may start before the previous kernel in the stream ends (programmatic dependent
    launch: compute capability >= 9.0 and a CUDA 12.3+ driver, which also captures it into graphs; KVTIER_PDL=0
    turns it off)."""
    return (os.environ.get("KVTIER_PDL", "1") != "0" and torch.cuda.get_device_capability(device)[0] >= 9
            and _driver_version() >= 12030)


CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81
CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK = 111


def device_attribute(device_index: int, attribute: int) -> int:
    """cuDeviceGetAttribute of the device PyTorch calls device_index."""
    cuda, dev, value = driver_library(), ctypes.c_int(), ctypes.c_int()
    check_driver(cuda.cuInit(0), "init")
    check_driver(cuda.cuDeviceGet(ctypes.byref(dev), device_index), "device")
    check_driver(cuda.cuDeviceGetAttribute(ctypes.byref(value), attribute, dev), "device attribute")
    return value.value


def launch(func: ctypes.c_void_p, grid: tuple[int, int, int], threads: int, smem_bytes: int,
           params: ctypes.Structure, device: torch.device, *, programmatic: bool = False) -> None:
    """cuLaunchKernel(func) with one by-value argument (params) on PyTorch's current stream of device.

    programmatic (where programmatic_launch_ok): the kernel's programs may start once every program of the
    previous kernel in the stream has started and signalled (griddepcontrol.launch_dependents) or ended, instead
    of after it ends; only for a kernel that reads nothing the previous one writes and waits for it
    (griddepcontrol.wait) before it ends, so the launches after it still find both done."""
    args = (ctypes.c_void_p * 1)(ctypes.addressof(params))
    stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
    with torch.cuda.device(device):  # the function belongs to this device's context, which must be current
        if not programmatic:
            check_driver(driver_library().cuLaunchKernel(func, *grid, threads, 1, 1, smem_bytes, stream, args, None),
                         "launch")
            return
        attr = _LaunchAttribute(id=_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        config = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(threads, 1, 1), smem_bytes, stream,
                               ctypes.pointer(attr), 1)
        check_driver(driver_library().cuLaunchKernelEx(ctypes.byref(config), func, args, None), "launch")
