"""Offline sm_90 compile of q_int8_kernel.py: registers, shared memory; then loopcount.py /tmp/sass/imma_w4s2.sass."""
import sys; import os; here = os.path.dirname(os.path.abspath(__file__)); sys.path[:0] = [here, os.path.join(here, "../../../..")]
from diag_regs import build
import q_int8_kernel as imma
ptr = {"q_ptr": "*fp16", "warm_ptr": "*i8", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "table_ptr": "*i32",
       "num_tokens_ptr": "*i32", "o_part_ptr": "*fp32", "lse_part_ptr": "*fp32", "lse_block_ptr": "*fp32"}
c = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, BLOCK_TOKENS=64, USE_ASM=True)
for w, s in ((4, 2), (4, 3)):
    build(imma._imma_kernel, ptr, c, w, s, f"imma_w{w}s{s}", div=("s_q_", "s_warm_", "s_ks_", "s_vs_", "s_tab_"))
