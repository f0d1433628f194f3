"""kvcuda/nvrtc.py: the disk cache of compiled kernels, and NVRTC compiling the shared header (no GPU needed)."""

from __future__ import annotations

import pytest

from kvcuda import nvrtc

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
