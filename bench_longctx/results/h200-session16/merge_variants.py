"""Session 16: what the merge (kvstore/attention/merge.py) costs over a partitioned 1M row's 66 splits (two
64-wide steps of its loop; 33 splits, one pool's, take one), and variants of its loop, each timed as GPU
microseconds of its kernel per call (torch.profiler over a CUDA graph of 50 calls), outputs checked against
merge_splits. Shapes: llama3-8b layer (32 q / 8 kv heads, head_dim 128), 16,384 blocks, block mass on.

    shipped_33 / shipped_66   merge_splits itself over 33 / 66 splits (the floor and what a mixed table pays)
    shipped_N / w64_N         (call 3, merge.py's steps now 128 wide) merge_splits and this file's kernel at 64-wide
                              steps (merge.py before) over N = 256, 1024, 2112 splits (a one-tile walk's tiles)
    same_66                   this file's kernel, unpipelined: must match shipped_66 (the harness's control)
    stages1_66                the same, num_stages=1 (no Triton loop pipelining)
    pipelined_66[_w8]         the next step's loads issued before this step's arithmetic (4 / 8 warps)
    chunk128_66_w4            one 128-wide step at 4 warps (session 15 tried 8: 15.2 us)

    python merge_variants.py OUT_DIR
"""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile

from bench_longctx.step_profile import kernel_table
from bench_longctx.timing import environment, write_json
from kvstore.attention.merge import merge_splits
from kvstore.attention.plan import DecodeGeometry

CALLS = 50
NQ, H, D, BLOCKS = 32, 8, 128, 16384


@triton.jit
def _load_step(lse_part_ptr, o_part_ptr, rows, row_p, g_ok, offs_s, offs_d, s0, num_splits, out_splits,
               HEAD_DIM: tl.constexpr):
    s_ok = s0 + offs_s < num_splits
    lse = tl.load(lse_part_ptr + rows[:, None] * num_splits + s0 + offs_s[None, :],
                  mask=g_ok[:, None] & s_ok[None, :], other=float("-inf"))
    o_ok = s0 + offs_s < out_splits
    lse_p = tl.load(lse_part_ptr + row_p * num_splits + s0 + offs_s, mask=o_ok, other=float("-inf"))
    o = tl.load(o_part_ptr + (row_p * num_splits + s0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=o_ok[:, None], other=0.0)
    return lse, lse_p, o


@triton.jit
def _variant_kernel(o_part_ptr, lse_part_ptr, lse_block_ptr, num_tokens_ptr, out_ptr, mass_ptr, num_kv_heads,
                    num_splits, max_blocks, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
                    SPLIT_CHUNK: tl.constexpr, MASS_CHUNK: tl.constexpr, PIPELINE: tl.constexpr):
    """merge.py's _merge_kernel with RETURN_MASS and STORE_MASS, GROUP a power of two; PIPELINE: the loop's
    loads one step ahead."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.program_id(2)
    offs_g = tl.arange(0, GROUP)
    offs_s = tl.arange(0, SPLIT_CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_j = p * MASS_CHUNK + tl.arange(0, MASS_CHUNK)
    g_ok = offs_g < GROUP
    out_splits = tl.where(p < GROUP, num_splits, 0)
    rows = (b * num_kv_heads + head) * GROUP + offs_g
    row_p = (b * num_kv_heads + head) * GROUP + p
    lse_block = tl.load(lse_block_ptr + rows[:, None] * max_blocks + offs_j[None, :],
                        mask=(offs_j < max_blocks)[None, :], other=0.0)
    n_blocks = tl.cdiv(tl.load(num_tokens_ptr + b), BLOCK_TOKENS)
    m = tl.full([GROUP], float("-inf"), tl.float32)
    total = tl.zeros([GROUP], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    if PIPELINE:
        lse, lse_p, o = _load_step(lse_part_ptr, o_part_ptr, rows, row_p, g_ok, offs_s, offs_d, 0, num_splits,
                                   out_splits, HEAD_DIM)
    for s0 in range(0, num_splits, SPLIT_CHUNK):
        if PIPELINE:
            lse_n, lse_pn, o_n = _load_step(lse_part_ptr, o_part_ptr, rows, row_p, g_ok, offs_s, offs_d,
                                            s0 + SPLIT_CHUNK, num_splits, out_splits, HEAD_DIM)
        else:
            lse, lse_p, o = _load_step(lse_part_ptr, o_part_ptr, rows, row_p, g_ok, offs_s, offs_d, s0, num_splits,
                                       out_splits, HEAD_DIM)
        m_new = tl.maximum(m, tl.max(lse, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_ref)
        total = total * alpha + tl.sum(tl.exp2(lse - m_ref[:, None]), 1)
        m_ref_p = tl.sum(tl.where(offs_g == p, m_ref, 0.0), 0)
        alpha_p = tl.sum(tl.where(offs_g == p, alpha, 0.0), 0)
        acc = acc * alpha_p + tl.sum(tl.exp2(lse_p - m_ref_p)[:, None] * o, 0)
        m = m_new
        if PIPELINE:
            lse, lse_p, o = lse_n, lse_pn, o_n
    if p < GROUP:
        total_p = tl.sum(tl.where(offs_g == p, total, 0.0), 0)
        out = acc / tl.where(total_p > 0, total_p, 1.0)
        tl.store(out_ptr + (b * num_kv_heads * GROUP + head * GROUP + p) * HEAD_DIM + offs_d, out.to(tl.float16))
    m = tl.where(m == float("-inf"), 0.0, m)
    lse_all = tl.where(total > 0, m + tl.log2(tl.where(total > 0, total, 1.0)), 0.0)
    ok = (offs_j < n_blocks)[None, :] & g_ok[:, None]
    mass = tl.sum(tl.exp2(tl.where(ok, lse_block - lse_all[:, None], float("-inf"))), 0) / GROUP
    tl.store(mass_ptr + (b * num_kv_heads + head) * max_blocks + offs_j, mass, mask=offs_j < max_blocks)


def _inputs(splits: int, device: torch.device) -> tuple:
    gen = torch.Generator(device=device).manual_seed(splits)
    o_part = torch.randn((1, NQ, splits, D), device=device, generator=gen)
    lse_part = torch.randn((1, NQ, splits), device=device, generator=gen) * 4 + 20
    lse_block = torch.randn((1, NQ, BLOCKS), device=device, generator=gen) * 4 + 10
    return o_part, lse_part, lse_block, torch.tensor([BLOCKS * 64], dtype=torch.int32, device=device)


def _variant(inputs: tuple, chunk: int, warps: int, stages: int | None, pipeline: bool):
    o_part, lse_part, lse_block, num_tokens = inputs
    out = torch.empty((1, NQ, D), dtype=torch.float16, device=o_part.device)
    mass = torch.empty((1, H, BLOCKS), device=o_part.device)
    extra = {} if stages is None else {"num_stages": stages}

    def run():
        _variant_kernel[(1, H, max(NQ // H, BLOCKS // 256))](
            o_part, lse_part, lse_block, num_tokens, out, mass, H, o_part.shape[2], BLOCKS, GROUP=NQ // H,
            HEAD_DIM=D, BLOCK_TOKENS=64, SPLIT_CHUNK=chunk, MASS_CHUNK=256, PIPELINE=pipeline, num_warps=warps,
            **extra)
        return out, mass
    return run


def _gpu_us(fn, device: torch.device) -> float:
    fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize(device)
    return sum(r["us_per_token"] for r in kernel_table(prof, 5 * CALLS))


def main() -> None:
    out_dir = sys.argv[1]
    device = torch.device("cuda")
    geom = DecodeGeometry(1, NQ, H, D, 64, BLOCKS)
    result = {**environment(device)}
    for splits in (33, 66):
        inputs = _inputs(splits, device)
        shipped = lambda inputs=inputs: merge_splits(*inputs[:3], inputs[3], geom, True)  # noqa: E731
        result[f"shipped_{splits}_us"] = _gpu_us(shipped, device)
    inputs = _inputs(66, device)
    want_out, want_mass = merge_splits(*inputs[:3], inputs[3], geom, True)
    variants = {"same_66": (64, 4, None, False), "stages1_66": (64, 4, 1, False),
                "pipelined_66": (64, 4, 1, True), "pipelined_66_w8": (64, 8, 1, True),
                "chunk128_66_w4": (128, 4, None, False)}
    for name, (chunk, warps, stages, pipeline) in variants.items():
        try:
            run = _variant(inputs, chunk, warps, stages, pipeline)
            out, mass = run()
            result[f"{name}_max_err"] = [float((out.float() - want_out.float()).abs().max()),
                                         float((mass - want_mass).abs().max())]
            result[f"{name}_us"] = _gpu_us(run, device)
        except Exception as exc:  # a variant that does not compile is a result too
            result[f"{name}_error"] = repr(exc)[:300]
        print(name, {k: v for k, v in result.items() if k.startswith(name)}, flush=True)
    for splits in (256, 1024, 2112):
        inputs = _inputs(splits, device)
        want_out, want_mass = merge_splits(*inputs[:3], inputs[3], geom, True)
        result[f"shipped_{splits}_us"] = _gpu_us(lambda: merge_splits(*inputs[:3], inputs[3], geom, True), device)
        run = _variant(inputs, 64, 4, None, False)
        out, mass = run()
        result[f"w64_{splits}_max_err"] = [float((out.float() - want_out.float()).abs().max()),
                                           float((mass - want_mass).abs().max())]
        result[f"w64_{splits}_us"] = _gpu_us(run, device)
        print(splits, result[f"shipped_{splits}_us"], result[f"w64_{splits}_us"], flush=True)
    print(json.dumps(result))
    write_json(out_dir, "merge_variants.json", result)


if __name__ == "__main__":
    main()
