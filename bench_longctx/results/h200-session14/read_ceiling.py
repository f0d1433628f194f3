"""Session 14: how fast the H200 streams the bytes of one 1M-token llama3-8b layer when nothing is done with them,
against SDPA over fp16 and paged_decode over int8 (warm pool only, block 64) in the same run: issue 10's "int8
warm-only >= 1.7x SDPA" asks the int8 walk to take <= SDPA / 1.7; this says what a pure read of its bytes takes.

    python bench_longctx/results/h200-session14/read_ceiling.py OUT_DIR

Read-only stream: a Triton kernel where each program sums 16-byte vectors of its contiguous share (int32 words,
xor-reduced, one word written per program); grid of 4 x SMs programs, 8 warps. Bytes: the int8 case's K, V and
scales exactly as int8_bench counts them (2 T D + 4 (D + T) per block and kv head), fp16 K/V as SDPA reads them.
"""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl

from bench_longctx.int8_bench import HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS, bytes_needed, case_args, make_pools, sdpa_ms
from bench_longctx.timing import copy_ceiling_GBps, environment, time_ms, write_json
from kvstore.attention.paged_decode import paged_decode


@triton.jit
def _read_kernel(x_ptr, out_ptr, words_per_program, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = x_ptr + pid.to(tl.int64) * words_per_program
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(0, words_per_program, BLOCK):
        acc ^= tl.load(base + i + tl.arange(0, BLOCK))
    tl.store(out_ptr + pid, tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def read_ms(nbytes: int, device: torch.device) -> float:
    programs = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    block = 2048  # int32 words per iteration of a program: 8 KiB
    per_program = triton.cdiv(nbytes // 4, programs * block) * block
    x = torch.randint(-2**31, 2**31 - 1, (programs * per_program,), dtype=torch.int32, device=device)
    out = torch.empty(programs, dtype=torch.int32, device=device)
    ms = time_ms(lambda: _read_kernel[(programs,)](x, out, per_program, BLOCK=block, num_warps=8), device)
    read = programs * per_program * 4
    del x
    torch.cuda.empty_cache()
    return ms * nbytes / read  # scaled to exactly nbytes (the grid rounds up by < 0.1%)


def main() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    tokens, block_tokens = 1 << 20, 64
    q = torch.randn((1, NUM_Q_HEADS, HEAD_DIM), dtype=torch.float16, device=device)
    ceiling = copy_ceiling_GBps(device)
    sdpa = sdpa_ms(tokens, q)
    pools = make_pools(tokens, block_tokens, device)
    args = case_args(pools, "int8", q)
    int8 = time_ms(lambda: paged_decode(*args), device)
    int8_mass = time_ms(lambda: paged_decode(*args, return_block_mass=True), device)
    int8_bytes, fp16_bytes = bytes_needed(pools, "int8"), bytes_needed(pools, "sdpa")
    del pools, args
    torch.cuda.empty_cache()
    read_int8, read_fp16 = read_ms(int8_bytes, device), read_ms(fp16_bytes, device)
    result = {
        **environment(device), "tokens": tokens, "block_tokens": block_tokens, "kv_heads": NUM_KV_HEADS,
        "copy_ceiling_GBps": ceiling, "int8_bytes": int8_bytes, "fp16_bytes": fp16_bytes,
        "sdpa_ms": sdpa, "sdpa_GBps": fp16_bytes / sdpa / 1e6,
        "read_fp16_ms": read_fp16, "read_fp16_GBps": fp16_bytes / read_fp16 / 1e6,
        "int8_ms": int8, "int8_with_mass_ms": int8_mass, "int8_GBps": int8_bytes / int8 / 1e6,
        "read_int8_ms": read_int8, "read_int8_GBps": int8_bytes / read_int8 / 1e6,
        "goal_int8_ms": sdpa / 1.7, "int8_vs_sdpa": sdpa / int8, "read_int8_vs_sdpa": sdpa / read_int8,
        "int8_of_read": read_int8 / int8, "sdpa_of_read": read_fp16 / sdpa,
    }
    print(json.dumps(result, indent=1))
    write_json(sys.argv[1], "read_ceiling.json", result)


if __name__ == "__main__":
    main()
