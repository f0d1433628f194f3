"""CUDA C++ kernels compiled at run time: NVRTC compile, on-disk CUBIN cache, driver load, launch on PyTorch's
stream (nvrtc.py), and the device helpers the kernels share (device.cuh).

The kernels live beside their callers (kvstore/attention/int8_mma.cu, eviction/sketch_mma.cu); this package
only builds and launches them. NVRTC ships with every CUDA build of PyTorch, so no CUDA toolkit is needed, and
it compiles without a GPU (the test suite does, for sm_90). Imports only torch.
"""
