"""The CUDA int8 split walk (kvstore/attention/int8_mma.cu) against paged_decode_ref and the Triton kernel.

On a GPU, each case first asserts that the CUDA kernel is the one serving its warm launches (so a silent fall
back to Triton cannot pass for it), then compares outputs, block mass and log-sum-exp with the torch reference
and with the Triton kernel (KVTIER_INT8_MMA=0) on the same poisoned pools (cases.py: NaN in every byte the
kernel must not read). Without a GPU only the host-side contract is checked: the ctypes mirror of the kernel's
parameter struct, and NVRTC compiling the kernel for sm_90 where libnvrtc is installed.
"""

from __future__ import annotations


import pytest
import torch

from kvcuda import nvrtc
from kvstore.attention import int8_mma
from kvstore.attention.paged_decode import paged_decode
from kvstore.attention.plan import PROGRAMS_PER_SM, check_decode_inputs
from kvstore.attention.reference import paged_decode_ref
from tests.kvstore.attention.cases import dense_lse, make_case

cuda = pytest.mark.cuda
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# lengths, kv heads, group, head_dim, block_tokens, fraction int8: irregular lengths, every supported geometry
GRID = [
    ([1000, 37], 2, 4, 128, 32, 1.0),
    ([515], 3, 3, 128, 16, 1.0),
    ([777, 64], 1, 8, 64, 64, 1.0),
    ([1300], 2, 1, 128, 128, 1.0),
    ([901, 5, 0], 2, 4, 128, 32, 0.6),
    ([640], 2, 2, 64, 16, 0.7),
    ([2049], 1, 5, 128, 64, 0.5),
]


def test_nvrtc_compiles_every_geometry() -> None:
    if nvrtc.nvrtc_library() is None:
        pytest.skip("libnvrtc not installed (CPU builds of PyTorch do not ship it)")
    for d in int8_mma._HEAD_DIMS:
        for t in int8_mma._BLOCK_TOKENS:
            assert len(int8_mma.compile_cubin(d, t, "sm_90")) > 1000



def test_cpu_tensors_never_take_the_cuda_kernel() -> None:
    case = make_case([100], 1, 4, 128, 32, 1.0, empty_pool="hot")
    if case.q.is_cuda:
        pytest.skip("CPU tensors only")
    geom = check_decode_inputs(*case.args())
    assert not int8_mma.usable(case.q, case.warm_data, case.k_scale, case.v_scale, case.table, geom, 0.1)


def _run(case, monkeypatch, enabled: bool, **kwargs):
    monkeypatch.setenv("KVTIER_INT8_MMA", "1" if enabled else "0")
    lse = torch.empty(case.q.shape[:2], dtype=torch.float32, device=case.q.device)
    out, mass = paged_decode(*case.args(), return_block_mass=True, lse_out=lse, **kwargs)
    return out, mass, lse


@cuda
@needs_gpu
@pytest.mark.parametrize("row", GRID, ids=lambda r: f"d{r[3]}_t{r[4]}_g{r[2]}_int8{r[5]}")
@pytest.mark.parametrize("splits", [1, 5])
def test_cuda_int8_matches_reference_and_triton(row, splits: int, monkeypatch) -> None:
    lengths, heads, group, head_dim, block_tokens, frac = row
    case = make_case(lengths, heads, group, head_dim, block_tokens, frac, seed=head_dim + block_tokens + group,
                     empty_pool="hot" if frac == 1.0 else None)
    geom = check_decode_inputs(*case.args())
    assert int8_mma.usable(case.q, case.warm_data, case.k_scale, case.v_scale, case.table, geom, 0.1)
    out, mass, lse = _run(case, monkeypatch, True, num_splits=splits)
    ref_out, ref_mass = paged_decode_ref(*case.args(), return_block_mass=True)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=4e-3, rtol=1e-2)
    torch.testing.assert_close(mass, ref_mass, atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(lse.cpu(), dense_lse(case), atol=2e-3, rtol=1e-3)
    tri_out, tri_mass, tri_lse = _run(case, monkeypatch, False, num_splits=splits)
    torch.testing.assert_close(out.float(), tri_out.float(), atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(mass, tri_mass, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(lse, tri_lse, atol=1e-3, rtol=1e-4)


@cuda
@needs_gpu
def test_cuda_int8_in_a_cuda_graph(monkeypatch) -> None:
    """Captured and replayed after the pools change: the replay reads the new bytes (no host copy of them)."""
    monkeypatch.setenv("KVTIER_INT8_MMA", "1")
    case = make_case([1536], 2, 4, 128, 32, 1.0, seed=7, empty_pool="hot")  # whole blocks: no poisoned tail to flip in
    out = torch.empty_like(case.q)

    def step() -> None:
        out.copy_(paged_decode(*case.args(), num_splits=4)[0])

    step()  # compiles and loads the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    case.q.mul_(-0.5)
    case.warm_data.copy_(case.warm_data.flip(3))  # every block's tokens reversed in place
    case.v_scale.copy_(case.v_scale.flip(2))
    graph.replay()
    torch.cuda.synchronize()
    ref_out, _ = paged_decode_ref(*case.args())
    torch.testing.assert_close(out.float(), ref_out.float(), atol=4e-3, rtol=1e-2)


@cuda
@needs_gpu
@pytest.mark.parametrize("frac", [0.02, 0.5, 0.95])
def test_programmatic_int8_launch_equals_the_plain_one(frac: float, monkeypatch) -> None:
    """The partition walk's int8 launch overlapping its fp16 launch (sm_90) writes what it writes launched after
    it: eagerly and replayed from a CUDA graph, equal to the reference."""
    if not nvrtc.programmatic_launch_ok(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    monkeypatch.setenv("KVTIER_INT8_MMA", "1")
    case = make_case([20000, 9000], 2, 4, 128, 64, frac, seed=11)
    runs = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("KVTIER_PDL", pdl)
        lse = torch.empty(case.q.shape[:2], dtype=torch.float32, device=case.q.device)
        out, mass = paged_decode(*case.args(), return_block_mass=True, lse_out=lse, walk="partition", num_splits=6)
        runs[pdl] = (out, mass, lse)
    for a, b in zip(runs["0"], runs["1"]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    ref_out, ref_mass = paged_decode_ref(*case.args(), return_block_mass=True)
    torch.testing.assert_close(runs["1"][0].float(), ref_out.float(), atol=4e-3, rtol=1e-2)
    torch.testing.assert_close(runs["1"][1], ref_mass, atol=1e-3, rtol=1e-2)
    out = torch.empty_like(case.q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(paged_decode(*case.args(), walk="partition", num_splits=6)[0])
    case.q.mul_(-0.5)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), paged_decode_ref(*case.args())[0].float(), atol=4e-3, rtol=1e-2)


@cuda
@needs_gpu
@pytest.mark.parametrize("head_dim,block_tokens", [(128, 64), (64, 16)])
def test_an_sm_holds_at_most_two_programs(head_dim: int, block_tokens: int) -> None:
    """The grid is sized for 2 programs an SM; the shared memory a launch asks for keeps a third off every SM, so a
    programmatic launch cannot crowd some SMs while others idle."""
    import ctypes

    dev = torch.cuda.current_device()
    func = int8_mma._function(head_dim, block_tokens, dev)
    n = ctypes.c_int()
    with torch.cuda.device(dev):
        nvrtc.check_driver(nvrtc.driver_library().cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(n), func, int8_mma._WARPS * 32, int8_mma.launch_smem(head_dim, block_tokens, dev)), "occupancy")
    assert n.value == PROGRAMS_PER_SM
