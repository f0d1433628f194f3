"""Session 14: does the int8 walk miss its 1.7x for its code or for where its bytes lie? One 1M-token llama3-8b
layer of int8 blocks (block 64), read four ways in one run, with SDPA over fp16 beside them:

    walk      paged_decode over the warm pool (the CUDA int8 walk), as int8_bench times it
    gather    a Triton kernel that reads exactly the walk's bytes for each (kv head, table entry): the block's K
              and V rows (8 KiB each), its K scales (512 B) and V scales (256 B), xor-reducing them, nothing else
    flat      a read of the same number of bytes laid out contiguously (read_ceiling.py's kernel)
each over the table int8_bench uses (a random permutation of the slots: blocks cooled at different times) and over
slots in order (a pool filled in order, as a prefill's blocks are).

    python bench_longctx/results/h200-session14/gather_ceiling.py OUT_DIR
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench_longctx.int8_bench import HEAD_DIM, NUM_Q_HEADS, bytes_needed, case_args, make_pools, sdpa_ms
from bench_longctx.timing import copy_ceiling_GBps, environment, time_ms, write_json
from kvstore.attention.paged_decode import paged_decode

_spec = importlib.util.spec_from_file_location("read_ceiling", Path(__file__).with_name("read_ceiling.py"))
read_ceiling = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(read_ceiling)


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _gather_kernel(warm_ptr, ks_ptr, vs_ptr, table_ptr, out_ptr, n_blocks, blocks_per_program,
                   s_w_slot, s_w_kv, s_w_head, s_ks_slot, s_ks_head, s_vs_slot, s_vs_head,
                   T: tl.constexpr, D4: tl.constexpr):
    """Program (kv head, p): entries [p * blocks_per_program, ...) of the table; warm viewed as int32 words."""
    head = tl.program_id(0)
    pid = tl.program_id(1)
    offs_t = tl.arange(0, T)
    offs_w = tl.arange(0, D4)
    tile = offs_t[:, None] * D4 + offs_w[None, :]  # a block's [T, D/4] words of one kv head
    acc = tl.zeros([T, D4], tl.int32)
    side = tl.zeros([D4 * 4], tl.int32)
    lo = pid * blocks_per_program
    for j in range(lo, tl.minimum(lo + blocks_per_program, n_blocks)):
        slot = tl.load(table_ptr + j).to(tl.int64)
        base = warm_ptr + slot * s_w_slot + head * s_w_head
        acc ^= tl.load(base + tile)  # K
        acc ^= tl.load(base + s_w_kv + tile)  # V
        side ^= tl.load(ks_ptr + slot * s_ks_slot + head * s_ks_head + tl.arange(0, D4 * 4))  # K scales [D]
        lanes = tl.arange(0, D4 * 4)
        side ^= tl.load(vs_ptr + slot * s_vs_slot + head * s_vs_head + lanes, mask=lanes < T, other=0)  # V scales
    total = tl.reduce(tl.reduce(acc, 1, _xor), 0, _xor) ^ tl.reduce(side, 0, _xor)
    tl.store(out_ptr + head * tl.num_programs(1) + pid, total)


def gather_ms(pools: dict, table: torch.Tensor, device: torch.device, programs_per_head: int = 66) -> float:
    warm, k_scale, v_scale = pools["warm"]
    words = warm.view(torch.int32)  # [n, 2, H, T, D / 4]
    ks, vs = k_scale.view(torch.int32), v_scale.view(torch.int32)
    n, heads = pools["n"], words.shape[2]
    per = triton.cdiv(n, programs_per_head)
    out = torch.empty(heads * programs_per_head, dtype=torch.int32, device=device)
    t, d4 = words.shape[3], words.shape[4]
    assert d4 * 4 >= t  # the V scales are read by the first T of D lanes
    return time_ms(lambda: _gather_kernel[(heads, programs_per_head)](
        words, ks, vs, table, out, n, per, words.stride(0), words.stride(1), words.stride(2),
        ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1), T=t, D4=d4, num_warps=8), device)


def main() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    tokens, block_tokens = 1 << 20, 64
    q = torch.randn((1, NUM_Q_HEADS, HEAD_DIM), dtype=torch.float16, device=device)
    result = {**environment(device), "tokens": tokens, "block_tokens": block_tokens,
              "copy_ceiling_GBps": copy_ceiling_GBps(device), "sdpa_ms": sdpa_ms(tokens, q)}
    pools = make_pools(tokens, block_tokens, device)
    nbytes = bytes_needed(pools, "int8")
    random_table = pools["table"]  # [1, H, n]: one permutation shared by the kv heads
    for name, row in (("random", random_table[0, 0]), ("in_order", torch.arange(pools["n"], device=device).int())):
        pools["table"] = row[None, None].expand_as(random_table)
        args = case_args(pools, "int8", q)
        result[f"walk_{name}_ms"] = time_ms(lambda: paged_decode(*args), device)
        result[f"walk_{name}_mass_ms"] = time_ms(lambda: paged_decode(*args, return_block_mass=True), device)
        result[f"gather_{name}_ms"] = gather_ms(pools, row.contiguous(), device)
    del pools, args
    torch.cuda.empty_cache()
    result["flat_ms"] = read_ceiling.read_ms(nbytes, device)
    result["bytes"] = nbytes
    for key in [k for k in result if k.endswith("_ms") and k != "sdpa_ms"]:
        result[key.replace("_ms", "_vs_sdpa")] = result["sdpa_ms"] / result[key]
    result["goal_ms"] = result["sdpa_ms"] / 1.7
    print(json.dumps(result, indent=1))
    write_json(sys.argv[1], "gather_ceiling.json", result)


if __name__ == "__main__":
    main()
