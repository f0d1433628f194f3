"""Offline sm_90 compile of the split kernel's int8 (warm-only) loop and fp16 loop: registers, spills, shared
memory, whether loads become cp.async, and the loop's instruction mix (session 6; triton of the CPU box, 3.9,
not the device's 3.6). Writes /tmp/sass/<build>.{cubin,sass,ttgir}; registers: cuobjdump -res-usage <cubin>."""
import re, subprocess, sys, collections, os
sys.path.insert(0, "/work/main")
import triton
from triton.compiler import ASTSource, compile as tcompile
from triton.backends.compiler import GPUTarget
from kvstore.attention import paged_decode as pd

def sig_for(kernel, ptr_types, consts):
    sig = {}
    for p in kernel.params:
        n = p.name
        if n in consts:
            sig[n] = "constexpr"
        elif n in ptr_types:
            sig[n] = ptr_types[n]
        elif n == "qk_scale":
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    return sig

def build(kernel, ptr_types, consts, warps, stages, label):
    div = ("s_q_", "s_hot_", "s_warm_", "s_ks_", "s_vs_")
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.params)
             if p.name in ptr_types or (p.name.startswith(div) and p.name not in consts)}
    src = ASTSource(fn=kernel, signature=sig_for(kernel, ptr_types, consts), constexprs=consts, attrs=attrs)
    k = tcompile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    md = k.metadata
    ttgir = k.asm["ttgir"]
    cubin = k.asm["cubin"]
    open(f"/tmp/sass/{label}.cubin", "wb").write(cubin)
    sass = subprocess.run([os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"), "-sass",
                           f"/tmp/sass/{label}.cubin"], capture_output=True, text=True).stdout
    open(f"/tmp/sass/{label}.sass", "w").write(sass)
    open(f"/tmp/sass/{label}.ttgir", "w").write(ttgir)
    ops = collections.Counter(m.group(1).split(".")[0] for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?P\d\s+)?([A-Z][A-Z0-9_.]+)", sass))
    ptx = k.asm["ptx"]
    regs = re.search(r"\.maxnreg|\.reg", ptx)
    print(f"{label}: shared {md.shared} B, n_regs {getattr(md, 'n_regs', '?')}, spills {getattr(md, 'n_spills', '?')}, "
          f"async copies in ttgir: {ttgir.count('async_copy_global_to_local')}, local_load {ttgir.count('local_load')}, "
          f"LDG {sum(v for o, v in ops.items() if o.startswith('LDG'))}, LDGSTS {ops['LDGSTS']}, "
          f"I2F {ops['I2F']}, PRMT {ops['PRMT']}, HMMA {ops['HMMA']}, total {sum(ops.values())}")
    ldg = collections.Counter(m.group(0) for m in re.finditer(r"LDG[A-Z0-9_.]*", sass))
    print("   loads:", dict(ldg))

ptr = {"q_ptr": "*fp16", "hot_ptr": "*fp16", "warm_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
       "table_ptr": "*i32", "pos_ptr": "*i32", "is_int8_ptr": "*i8", "num_tokens_ptr": "*i32", "num_fp16_ptr": "*i32",
       "o_part_ptr": "*fp32", "lse_part_ptr": "*fp32", "lse_block_ptr": "*fp32"}
base = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, BLOCK_TOKENS=64, BLOCKS_PER_ITER=2, PARTITIONED=False,
            RETURN_MASS=True, USE_ASM=True)
for warps, stages in ((4, 2), (4, 3), (8, 2)):
    build(pd._split_kernel, ptr, {**base, "HAS_HOT": False, "HAS_WARM": True}, warps, stages, f"int8_tile_w{warps}s{stages}")
    build(pd._split_kernel, ptr, {**base, "HAS_HOT": True, "HAS_WARM": False}, warps, stages, f"fp16_tile_w{warps}s{stages}")

import importlib.util
# the removed loops: git show 97abea5:kvstore/attention/int8_loop.py > /tmp/int8_loop_folded.py, f836a8b for prefetch
for path, label in (("/tmp/int8_loop_folded.py", "folded"), ("/tmp/int8_loop_prefetch.py", "prefetch")):
    spec = importlib.util.spec_from_file_location(label, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    kern = mod._int8_split_kernel
    ptr2 = {"q_ptr": "*fp16", "warm_ptr": "*i8", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "table_ptr": "*i32",
            "pos_ptr": "*i32", "num_tokens_ptr": "*i32", "num_fp16_ptr": "*i32", "o_part_ptr": "*fp32",
            "lse_part_ptr": "*fp32", "lse_block_ptr": "*fp32"}
    consts = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, BLOCK_TOKENS=64, PARTITIONED=False, RETURN_MASS=True)
    if label == "prefetch":
        consts["PREFETCH"] = True
    for warps, stages in ((4, 2), (4, 3), (2, 2)):
        build(kern, ptr2, consts, warps, stages, f"{label}_w{warps}s{stages}")
