"""(Run against d0aabda, whose channel kernel had the persistent loop and DECODE 2; both removed since.) Offline sm_90 compile (triton 3.9 of the CPU box; the device runs 3.6: indicative) of the sketch first level
(eviction/sketch_channels.py _channel_kernel): registers, shared memory, instruction mix per program.
Usage: python sass_channel.py [module:kernel] [CHANNELS ...]"""
import collections, importlib, os, re, subprocess, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../.."))
import triton
from triton.compiler import ASTSource, compile as tcompile
from triton.backends.compiler import GPUTarget
CUOBJ = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
os.makedirs("/tmp/sass", exist_ok=True)

PTR = {"q_ptr": "*fp16", "s_ptr": "*fp16", "c_ptr": "*u8", "ch_ptr": "*i32", "valid_ptr": "*i1", "lse_ptr": "*fp32",
       "upper_ptr": "*fp32", "z_ptr": "*fp32"}


def build(kernel, consts, warps, stages, label):
    sig = {p.name: "constexpr" if p.name in consts else PTR.get(p.name, "fp32" if p.name == "scale" else "i32")
           for p in kernel.params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.params)
             if p.name in PTR or (p.name.startswith("stride_") and p.name not in consts)}
    k = tcompile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                 target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    open(f"/tmp/sass/{label}.cubin", "wb").write(k.asm["cubin"])
    open(f"/tmp/sass/{label}.ttgir", "w").write(k.asm["ttgir"])
    regs = int(re.search(r"REG:(\d+)", subprocess.run([CUOBJ, "-res-usage", f"/tmp/sass/{label}.cubin"],
                                                       capture_output=True, text=True).stdout).group(1))
    sass = subprocess.run([CUOBJ, "-sass", f"/tmp/sass/{label}.cubin"], capture_output=True, text=True).stdout
    open(f"/tmp/sass/{label}.sass", "w").write(sass)
    ins = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", sass)]
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in ins)
    progs = min(65536 // (regs * 32 * warps), 232448 // max(k.metadata.shared, 1), 32)
    print(f"{label}: regs {regs}, shared {k.metadata.shared}, spills {'STL' in sass}, programs/SM ~{progs}, "
          f"{len(ins)} instructions ({len(ins) * warps} warp-instr per program)")
    print("   ", ops.most_common(24), flush=True)
    return len(ins) * warps


if __name__ == "__main__":
    mod, _, name = (sys.argv[1] if len(sys.argv) > 1 else "eviction.sketch_channels:_channel_kernel").partition(":")
    kernel = getattr(importlib.import_module(mod), name)
    variants = [tuple(int(x) for x in v.split("x")) for v in os.environ.get("VARIANTS", "16x4x1,8x4x2,4x4x2,4x2x2,4x2x3,2x2x3").split(",")]
    decodes = [int(x) for x in os.environ.get("DECODES", "1,2").split(",")]
    for ch, decode in [(int(x), d) for x in sys.argv[2:] or (16, 64) for d in decodes]:
        PTR["c_ptr"] = "*i32" if decode == 2 else "*u8"
        for blocks, warps, stages in variants:
            c = dict(GROUP=4, GROUP_PAD=4, HEAD_DIM=128, CHANNELS=ch, BLOCK_TOKENS=64, HALF_PAD=32, BLOCKS=blocks,
                     HAS_VALID=True, FULL=True, DECODE=decode, USE_ASM=True)
            c = {k: v for k, v in c.items() if k in {p.name for p in kernel.params}}
            build(kernel, c, warps, stages, f"{name}_r{ch}_d{decode}_b{blocks}w{warps}s{stages}")
            sass = open(f"/tmp/sass/{name}_r{ch}_d{decode}_b{blocks}w{warps}s{stages}.sass").read()
            print(f"    LDGSTS (async copies) {sass.count('LDGSTS')}, LDG {sass.count('LDG.')}")
