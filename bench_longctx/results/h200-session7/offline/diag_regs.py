"""Offline sm_90 compile (triton of the CPU box, 3.9; the device runs 3.6: indicative) of the split kernel's int8 (warm-only) and fp16 loops: registers, shared memory, programs per SM. Writes /tmp/sass/<label>.{cubin,sass,ttgir}."""
import re, subprocess, sys, os, itertools
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../.."))
import triton
from triton.compiler import ASTSource, compile as tcompile
from triton.backends.compiler import GPUTarget
from kvstore.attention import paged_decode as pd
CUOBJ = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")

def build(kernel, ptr_types, consts, warps, stages, label, div=("s_q_", "s_hot_", "s_warm_", "s_ks_", "s_vs_")):
    sig = {}
    for p in kernel.params:
        n = p.name
        sig[n] = "constexpr" if n in consts else ptr_types.get(n, "fp32" if n == "qk_scale" else "i32")
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.params)
             if p.name in ptr_types or (p.name.startswith(div) and p.name not in consts)}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    k = tcompile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    open(f"/tmp/sass/{label}.cubin", "wb").write(k.asm["cubin"])
    open(f"/tmp/sass/{label}.ttgir", "w").write(k.asm["ttgir"])
    res = subprocess.run([CUOBJ, "-res-usage", f"/tmp/sass/{label}.cubin"], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res).group(1)
    sass = subprocess.run([CUOBJ, "-sass", f"/tmp/sass/{label}.cubin"], capture_output=True, text=True).stdout
    open(f"/tmp/sass/{label}.sass", "w").write(sass)
    spill = "STL" in sass
    regs_i = int(regs)
    progs = min(65536 // (regs_i * 32 * warps), 232448 // max(k.metadata.shared, 1), 32)
    print(f"{label}: regs {regs}, shared {k.metadata.shared}, spills(STL) {spill}, programs/SM ~{progs}", flush=True)
    return k

PTR = {"q_ptr": "*fp16", "hot_ptr": "*fp16", "warm_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
       "table_ptr": "*i32", "pos_ptr": "*i32", "is_int8_ptr": "*i8", "num_tokens_ptr": "*i32", "num_fp16_ptr": "*i32",
       "o_part_ptr": "*fp32", "lse_part_ptr": "*fp32", "lse_block_ptr": "*fp32"}
if __name__ == "__main__":
    base = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, BLOCK_TOKENS=64, PARTITIONED=False, RETURN_MASS=True, USE_ASM=True)
    for bpi, warps, stages in itertools.product((1, 2), (2, 4), (1, 2, 3)):
        c = {**base, "BLOCKS_PER_ITER": bpi}
        build(pd._split_kernel, PTR, {**c, "HAS_HOT": False, "HAS_WARM": True}, warps, stages, f"int8_b{bpi}w{warps}s{stages}")
        if bpi == 2 and warps == 4:
            build(pd._split_kernel, PTR, {**c, "HAS_HOT": True, "HAS_WARM": False}, warps, stages, f"fp16_b{bpi}w{warps}s{stages}")
