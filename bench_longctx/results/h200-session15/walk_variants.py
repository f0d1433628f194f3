"""Session 15: variants of the int8 walk (kvstore/attention/int8_mma.cu) at 1M tokens, llama3-8b geometry, block 64,
int8 warm-only, through paged_decode (the walk + the merge), each against the unchanged kernel in the same run.
Each variant is a text edit of the .cu source (and of the launch's stages / shared memory where it changes them):

    ks_once      K's scales copied with a block's first chunk only (today every chunk copies them; only the first reads)
    l2_128       the K / V copies with cp.async's L2::128B prefetch hint
    l2_256       the same with L2::256B
    split_wait   a chunk's K and V in two cp.async groups: Q.K^T starts when K is in, P.V waits for V
    stages3      3 chunks in flight per warp (2 programs an SM instead of 3)
    ch16_s4      16-token chunks, 4 in flight per warp (same bytes in flight, finer steps), with ks_once
    combined     ks_once + l2_256 + split_wait

Outputs are compared with the unchanged kernel's (max abs difference of out and lse); times alternate base / variant.
The edits match session 14's kernel text, which call 1 ran (tree 403c2c5); on later trees they no longer apply, and
walk_variants2.py reuses only this file's machinery (source, use, main) with variants of the leaner kernel.

    python bench_longctx/results/h200-session15/walk_variants.py OUT_DIR [--source FILE.cu]  # FILE: compile only
"""

from __future__ import annotations

import json
import sys

import torch

from kvcuda import nvrtc
from kvstore.attention import int8_mma

PF = ('__device__ __forceinline__ void cp_async16_pf(void* dst, const void* src) {\n'
      '    asm volatile("cp.async.cg.shared.global.L2::%s [%%0], [%%1], 16;" :: "r"(smem_addr(dst)), "l"(src) : "memory");\n'
      '}\n')


def _sub(src: str, old: str, new: str) -> str:
    assert old in src, old
    return src.replace(old, new)


def ks_once(src: str) -> str:
    return _sub(src, "        for (int i = lane; i < D / 4; i += 32) cp_async16(dst + G::KS_OFF + 16 * i, ks + 4 * i);",
                "        if (t0 == 0)\n"
                "            for (int i = lane; i < D / 4; i += 32) cp_async16(dst + G::KS_OFF + 16 * i, ks + 4 * i);")


def l2(size: str):
    def edit(src: str) -> str:
        src = _sub(src, "struct Params {", PF % size + "\nstruct Params {")
        src = _sub(src, "cp_async16(dst + G::K_OFF + at", "cp_async16_pf(dst + G::K_OFF + at")
        return _sub(src, "cp_async16(dst + G::V_OFF + at", "cp_async16_pf(dst + G::V_OFF + at")
    return edit


def split_wait(src: str) -> str:
    src = _sub(src, "auto issue = [&](int item) {", "auto issue = [&](int item, int part) {")
    src = _sub(src, "            cp_async16(dst + G::K_OFF + at, src + i * src_step);\n"
                    "            cp_async16(dst + G::V_OFF + at, src + p.s_w_kv + i * src_step);",
               "            if (part == 0) cp_async16(dst + G::K_OFF + at, src + i * src_step);\n"
               "            else cp_async16(dst + G::V_OFF + at, src + p.s_w_kv + i * src_step);")
    src = _sub(src, "        const float* ks = p.k_scale", "        if (part == 1) return;\n        const float* ks = p.k_scale")
    src = _sub(src, "        if (s < n_items) issue(s);\n        cp_async_commit();",
               "        if (s < n_items) issue(s, 0);\n        cp_async_commit();\n"
               "        if (s < n_items) issue(s, 1);\n        cp_async_commit();")
    src = _sub(src, "        if (it + STAGES - 1 < n_items) issue(it + STAGES - 1);\n        cp_async_commit();\n"
                    "        cp_async_wait<STAGES - 1>();",
               "        if (it + STAGES - 1 < n_items) issue(it + STAGES - 1, 0);\n        cp_async_commit();\n"
               "        if (it + STAGES - 1 < n_items) issue(it + STAGES - 1, 1);\n        cp_async_commit();\n"
               "        cp_async_wait<2 * STAGES - 1>();")
    return _sub(src, "        const float* vsc = reinterpret_cast<const float*>(st + G::VS_OFF);",
                "        cp_async_wait<2 * STAGES - 2>();\n        __syncwarp();\n"
                "        const float* vsc = reinterpret_cast<const float*>(st + G::VS_OFF);")


def ch16(src: str) -> str:
    return _sub(src, "static constexpr int CH = T < 32 ? T : 32;", "static constexpr int CH = T < 16 ? T : 16;")


def chain(*edits):
    def edit(src: str) -> str:
        for e in edits:
            src = e(src)
        return src
    return edit


# name: (source edit, stages, programs per SM, chunk tokens)
VARIANTS = {
    "base": (lambda s: s, 2, 3, 32),
    "ks_once": (ks_once, 2, 3, 32),
    "l2_128": (l2("128B"), 2, 3, 32),
    "l2_256": (l2("256B"), 2, 3, 32),
    "split_wait": (split_wait, 2, 3, 32),
    "stages3": (lambda s: s, 3, 2, 32),
    "ch16_s4": (chain(ch16, ks_once), 4, 3, 16),
    "combined": (chain(ks_once, split_wait, l2("256B")), 2, 3, 32),
}


def source(name: str, head_dim: int, block_tokens: int) -> tuple[str, int, int]:
    """(CUDA source with its entry point, dynamic shared memory bytes, chunk tokens) of a variant."""
    edit, stages, per_sm, chunk = VARIANTS[name]
    body = edit(int8_mma._SOURCE.read_text())
    warps = int8_mma._WARPS
    entry = (f'\nextern "C" __global__ void __launch_bounds__({warps * 32}, {per_sm}) '
             f"{int8_mma.kernel_name(head_dim, block_tokens)}(const Params p) "
             f"{{ int8_split_body<{head_dim}, {block_tokens}, {warps}, {stages}>(p); }}\n")
    ch = min(block_tokens, chunk)
    stage = 2 * ch * head_dim + 4 * head_dim + 4 * ch + 16
    smem = max(warps * stages * stage, 4 * warps * (16 + 8 * head_dim))
    return body + entry, smem, ch


def use(name: str, head_dim: int, block_tokens: int, device_index: int) -> None:
    """Points int8_mma's launches at the variant's kernel."""
    src, smem, _ = source(name, head_dim, block_tokens)
    int8_mma.smem_bytes = lambda hd, bt: smem
    int8_mma.launch_smem.cache_clear()  # (session 16) what a launch asks: the variant's, capped as int8_mma caps it
    asked = int8_mma.launch_smem(head_dim, block_tokens, device_index)
    func = nvrtc.function(src, int8_mma._SOURCE.name, int8_mma.kernel_name(head_dim, block_tokens), device_index,
                          asked, "int8_mma_study")
    int8_mma._function = lambda hd, bt, dev: func


def main() -> None:
    if "--compile" in sys.argv:  # CPU check: every variant compiles for sm_90
        for name in VARIANTS:
            for hd, bt in ((128, 64), (64, 16), (128, 128)):
                src, smem, _ = source(name, hd, bt)
                assert smem <= 227 * 1024, (name, smem)
                nvrtc.compile_cubin(src, "int8_mma.cu", "sm_90")
            print("compiles:", name)
        return
    from bench_longctx.int8_bench import HEAD_DIM, NUM_Q_HEADS, case_args, make_pools, sdpa_ms
    from bench_longctx.timing import environment, time_ms, write_json
    from kvstore.attention.paged_decode import paged_decode

    device = torch.device("cuda")
    torch.manual_seed(0)
    tokens = 1 << 20
    q = torch.randn((1, NUM_Q_HEADS, HEAD_DIM), dtype=torch.float16, device=device)
    result = {**environment(device), "tokens": tokens, "sdpa_ms": sdpa_ms(tokens, q), "variants": {}}
    pools = make_pools(tokens, 64, device)
    args = case_args(pools, "int8", q)
    use("base", HEAD_DIM, 64, device.index or 0)
    ref_lse = torch.empty((1, NUM_Q_HEADS), device=device)
    ref_out, ref_mass = paged_decode(*args, return_block_mass=True, lse_out=ref_lse)
    lse = torch.empty_like(ref_lse)
    for name in VARIANTS:
        use(name, HEAD_DIM, 64, device.index or 0)
        out, mass = paged_decode(*args, return_block_mass=True, lse_out=lse)
        row = {"max_abs_out": float((out.float() - ref_out.float()).abs().max()),
               "max_abs_lse": float((lse - ref_lse).abs().max()),
               "max_abs_mass": float((mass - ref_mass).abs().max())}
        for rep in range(2):
            use("base", HEAD_DIM, 64, device.index or 0)
            row.setdefault("base_ms", []).append(time_ms(lambda: paged_decode(*args), device))
            use(name, HEAD_DIM, 64, device.index or 0)
            row.setdefault("ms", []).append(time_ms(lambda: paged_decode(*args), device))
            row.setdefault("mass_ms", []).append(time_ms(lambda: paged_decode(*args, return_block_mass=True), device))
        row["vs_sdpa"] = result["sdpa_ms"] / min(row["ms"])
        row["vs_base"] = min(row["base_ms"]) / min(row["ms"])
        result["variants"][name] = row
        print(name, json.dumps(row), flush=True)
    result["goal_ms"] = result["sdpa_ms"] / 1.7
    write_json(sys.argv[1], "walk_variants.json", result)


if __name__ == "__main__":
    main()
