"""kvcuda/nvrtc.py: the disk cache of compiled kernels, NVRTC compiling the shared header (no GPU needed); and what
every CUDA kernel module built on it keeps: a ctypes Params mirroring its .cu's struct, one warning and Triton when
its build fails."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from eviction import sketch_mma
from kvcuda import nvrtc
from kvstore.attention import int8_mma

# each kernel module and a geometry its _loads takes
KERNELS = [pytest.param(int8_mma, (128, 32, 0), id="int8_mma"),
           pytest.param(sketch_mma, (128, 64, 64, 0), id="sketch_mma")]

_SOURCE = '#include "kvcuda/device.cuh"\nextern "C" __global__ void probe(float* x) { x[threadIdx.x] = NEG_INF; }\n'


def test_an_unwritable_cache_still_gives_the_kernel_and_says_so(tmp_path, monkeypatch) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(blocked))  # the cache folder cannot be made under a file
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda *args: b"cubin bytes")
    with pytest.warns(RuntimeWarning, match="cannot cache the CUDA kernel probe"):
        assert nvrtc.cubin(_SOURCE, "probe.cu", "probe", "sm_90", "probe") == b"cubin bytes"


def test_the_cache_serves_the_second_build_and_a_changed_source_rebuilds(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    builds = []
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda src, *args: builds.append(src) or f"bin{len(builds)}".encode())
    assert nvrtc.cubin(_SOURCE, "probe.cu", "probe", "sm_90", "probe") == b"bin1"
    assert nvrtc.cubin(_SOURCE, "probe.cu", "probe", "sm_90", "probe") == b"bin1"  # from disk
    assert nvrtc.cubin(_SOURCE + "\n", "probe.cu", "probe", "sm_90", "probe") == b"bin2"
    assert nvrtc.cubin(_SOURCE, "probe.cu", "probe", "sm_80", "probe") == b"bin3"  # another arch
    assert len(builds) == 3


def test_nvrtc_compiles_with_the_shared_header_and_reports_errors() -> None:
    if nvrtc.nvrtc_library() is None:
        pytest.skip("libnvrtc not installed (CPU builds of PyTorch do not ship it)")
    assert len(nvrtc.compile_cubin(_SOURCE, "probe.cu", "sm_90")) > 500
    with pytest.raises(RuntimeError, match="NVRTC compile of broken.cu failed"):
        nvrtc.compile_cubin(_SOURCE + "this is not C++;\n", "broken.cu", "sm_90")


def struct_fields(source: Path, name: str = "Params") -> list[str]:
    """The field names of a C struct in a .cu file, in order."""
    body = re.search(rf"struct {name} \{{(.*?)\}};", source.read_text(), re.S).group(1)
    names = []
    for line in body.splitlines():
        for decl in line.split("//")[0].split(";"):
            decl = decl.strip()
            if decl:
                names += [re.sub(r"^.*[\s*]", "", part.strip()) for part in decl.split(",")]
    return names


@pytest.mark.parametrize("module,geometry", KERNELS)
def test_params_mirror_the_kernel_struct(module, geometry) -> None:
    """_Params must list the .cu's Params fields in the same order (the launch passes it by value)."""
    assert struct_fields(module._SOURCE) == [name for name, _ in module._Params._fields_]


@pytest.mark.parametrize("module,geometry", KERNELS)
def test_a_failed_load_falls_back_to_triton_with_one_warning(monkeypatch, module, geometry) -> None:
    """An NVRTC that cannot build the kernel (or a driver that cannot load it) must not fail a decode step."""
    def broken(*args):
        raise RuntimeError(f"NVRTC compile of {module._SOURCE.name} failed: (simulated)")

    monkeypatch.setattr(module, "_function", broken)
    module._loads.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="Triton's serves instead"):
            assert module._loads(*geometry) is False
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # asked again: the cached answer, no second warning
            assert module._loads(*geometry) is False
    finally:
        module._loads.cache_clear()



def test_launch_structs_have_cuda_h_layout() -> None:
    """cuLaunchKernelEx reads these by address: CUlaunchAttribute is 72 bytes (an id, padding, a 64-byte union at
    8), CUlaunchConfig 56 (7 uints, the stream at 32, the attribute pointer at 40, their count at 48)."""
    import ctypes

    assert ctypes.sizeof(nvrtc._LaunchAttribute) == 72 and nvrtc._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(nvrtc._LaunchConfig) == 56
    assert (nvrtc._LaunchConfig.stream.offset, nvrtc._LaunchConfig.attrs.offset,
            nvrtc._LaunchConfig.num_attrs.offset) == (32, 40, 48)


@pytest.mark.parametrize("capability,driver,env,ok", [
    ((9, 0), 13000, "1", True), ((9, 0), 12030, "1", True), ((9, 0), 12020, "1", False),
    ((8, 0), 13000, "1", False), ((9, 0), 13000, "0", False)])
def test_programmatic_launch_needs_sm90_a_capturing_driver_and_no_opt_out(monkeypatch, capability, driver, env,
                                                                          ok) -> None:
    monkeypatch.setattr(nvrtc.torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(nvrtc, "_driver_version", lambda: driver)
    monkeypatch.setenv("KVTIER_PDL", env)
    assert nvrtc.programmatic_launch_ok("cuda:0") is ok
