"""Session 15: the int8 walk at 1M tokens (int8_bench's int8 case), compiled with -lineinfo, launched a few times:
what Nsight Compute profiles (run1.sh, when the device has ncu).

    ncu --kernel-name regex:int8_split --clock-control none --launch-skip 2 --launch-count 1 --set full --import-source yes \
        -o walk python bench_longctx/results/h200-session15/walk_once.py
"""

import torch

from bench_longctx.int8_bench import HEAD_DIM, NUM_Q_HEADS, case_args, make_pools
from kvcuda import nvrtc
from kvstore.attention.paged_decode import paged_decode

nvrtc._OPTIONS = nvrtc._OPTIONS + ("-lineinfo",)
device = torch.device("cuda")
torch.manual_seed(0)
q = torch.randn((1, NUM_Q_HEADS, HEAD_DIM), dtype=torch.float16, device=device)
args = case_args(make_pools(1 << 20, 64, device), "int8", q)
for _ in range(4):
    paged_decode(*args)
torch.cuda.synchronize()
print("ok")
