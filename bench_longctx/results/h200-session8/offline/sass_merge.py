"""Offline sm_90 compile (triton 3.9 of the CPU box; the device runs 3.6: indicative) of the flash-decoding merge
(kvstore/attention/merge.py): registers, shared memory and spills per split chunk and warp count."""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../.."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_channel import PTR, build
from kvstore.attention import merge

PTR.clear()
PTR.update({n: "*fp32" for n in ("o_part_ptr", "lse_part_ptr", "lse_block_ptr", "mass_ptr", "scores_ptr",
                                 "lse_out_ptr")})
PTR.update({"num_tokens_ptr": "*i64", "out_ptr": "*fp16", "index_ptr": "*i64"})
for chunk in (64, 128):
    for warps in (4, 8):
        c = dict(GROUP=4, GROUP_PAD=4, HEAD_DIM=128, BLOCK_TOKENS=64, SPLIT_CHUNK=chunk, MASS_CHUNK=256,
                 RETURN_MASS=True, STORE_MASS=False, ADD_MASS=True, STORE_LSE=False)
        build(merge._merge_kernel, c, warps, 1, f"merge_c{chunk}_w{warps}")
