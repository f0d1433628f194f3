"""The sketch's first level as a CUDA kernel (eviction/sketch_mma.cu) against its torch reference and Triton's
kernel, on the GPU; on any machine: the launch struct mirrors the .cu's, NVRTC compiles every geometry, a failed
load falls back to Triton with one warning, CPU tensors never take it."""

from __future__ import annotations


import pytest
import torch

from bench_longctx.sketch_bench import true_block_lse
from eviction import sketch_mma
from eviction.sketch_channels import channel_block_stats, channel_block_stats_ref
from kvcuda import nvrtc
from tests.eviction.test_sketch_kernel import DEVICE, make_case

cuda = pytest.mark.cuda



def test_nvrtc_compiles_every_geometry() -> None:
    if nvrtc.nvrtc_library() is None:
        pytest.skip("libnvrtc not installed (CPU builds of PyTorch do not ship it)")
    for d in sketch_mma._HEAD_DIMS:
        for t in sketch_mma._BLOCK_TOKENS:
            for r in (c for c in (16, 32, 48, 64, 128) if c <= d):  # any multiple of 16: these are the used ones
                assert len(sketch_mma.compile_cubin(d, t, r, "sm_90")) > 1000



def test_cpu_tensors_never_take_the_cuda_kernel() -> None:
    q, summaries, codes, _ = make_case(64, 16, 2, 2, 64, seed=1)
    if q.is_cuda:
        pytest.skip("CPU tensors only")
    assert not sketch_mma.usable(q, summaries, codes, 16)


def _served_by_cuda(monkeypatch) -> list:
    calls = []
    real = sketch_mma.launch
    monkeypatch.setattr(sketch_mma, "launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@cuda
@pytest.mark.parametrize("num_tokens,block_tokens,num_kv_heads,group,head_dim,channels", [
    (19 * 64 - 3, 64, 2, 4, 128, 64),  # llama3-8b's group, head and blocks; partial tail; tiles past the end
    (64 * 64, 64, 1, 4, 128, 32),  # full blocks, exactly one program
    (37, 16, 2, 3, 64, 16),  # SmolLM2's group, one tile, partial tail
    (300 * 32 - 17, 32, 3, 3, 64, 32),
    (70 * 128 - 1, 128, 2, 8, 128, 128),  # every channel read, the largest group
    (45 * 16, 16, 2, 1, 128, 64),  # no GQA
    (9, 64, 3, 2, 64, 64),  # one partial block
    (130 * 64, 64, 2, 5, 64, 16),
    (21 * 64 - 5, 64, 2, 4, 128, 48),  # three k-steps of channels (no power of two), three copy pieces a lane
    (33 * 32, 32, 2, 3, 64, 48),
])
def test_cuda_kernel_matches_reference_and_triton(monkeypatch, num_tokens, block_tokens, num_kv_heads, group,
                                                  head_dim, channels) -> None:
    q, summaries, codes, keys = make_case(num_tokens, block_tokens, num_kv_heads, group, head_dim, seed=num_tokens)
    assert sketch_mma.usable(q, summaries, codes, channels)
    calls = _served_by_cuda(monkeypatch)
    got = channel_block_stats(q, summaries, codes, num_tokens, channels)
    assert calls, "the CUDA kernel did not serve"
    want = channel_block_stats_ref(q, summaries, codes, num_tokens, channels)
    triton = channel_block_stats(q, summaries, codes, num_tokens, channels, blocks_per_program=16)
    for g, w, t in zip(got, want, triton):
        assert g.shape == w.shape and g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=1e-5, atol=2e-4)
        torch.testing.assert_close(g, t, rtol=1e-5, atol=2e-4)
    true = true_block_lse(q, keys, block_tokens)
    assert bool((got[1] >= true).all())


@cuda
def test_cuda_kernel_blocks_outside_valid_hold_garbage(monkeypatch) -> None:
    q, summaries, codes, keys = make_case(40 * 32, 32, 2, 4, 128, seed=5)
    valid = torch.ones(40, dtype=torch.bool, device=DEVICE)
    valid[[2, 4, 17, 39]] = False
    summaries[2], summaries[4] = float("nan"), float("inf")
    codes[2], codes[17] = 255, 7
    calls = _served_by_cuda(monkeypatch)
    got = channel_block_stats(q, summaries, codes, keys.shape[0], 64, valid)
    assert calls
    want = channel_block_stats_ref(q, summaries, codes, keys.shape[0], 64, valid)
    for w, g in zip(want, got):
        assert bool((g[:, ~valid] == float("-inf")).all())
        torch.testing.assert_close(g, w, rtol=1e-5, atol=2e-4)


@cuda
def test_cuda_kernel_replays_in_a_graph_after_the_inputs_change(monkeypatch) -> None:
    q, summaries, codes, keys = make_case(50 * 64, 64, 2, 4, 128, seed=9)
    calls = _served_by_cuda(monkeypatch)
    channel_block_stats(q, summaries, codes, keys.shape[0], 64)  # compiled and loaded before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = channel_block_stats(q, summaries, codes, keys.shape[0], 64)
    q2, summaries2, codes2, _ = make_case(50 * 64, 64, 2, 4, 128, seed=10)
    q.copy_(q2), summaries.copy_(summaries2), codes.copy_(codes2)
    graph.replay()
    torch.cuda.synchronize()
    want = channel_block_stats_ref(q, summaries, codes, keys.shape[0], 64)
    assert len(calls) == 2
    for w, g in zip(want, out):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=2e-4)
