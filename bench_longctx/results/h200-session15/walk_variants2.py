"""Session 15: variants of the leaner int8 walk (this session's int8_mma.cu), 1M tokens, llama3-8b layer, block 64,
warm pool only, through paged_decode, each against the unchanged kernel in the same run (as walk_variants.py):

    stages3       3 chunks in flight per warp (2 programs an SM, as the planner's grid has anyway)
    prefetch_l2   with a block's first chunk, one lane each asks L2 for the next block's K and V
                  (cp.async.bulk.prefetch.L2, 8 KiB each): the copies after it find their bytes in L2
    both          the two together

    python bench_longctx/results/h200-session15/walk_variants2.py OUT_DIR | --compile
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("walk_variants", Path(__file__).with_name("walk_variants.py"))
wv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wv)


def prefetch_l2(src: str) -> str:
    return wv._sub(src, "        entry(blk, slot, pos);\n        const signed char* k_src",
                   "        entry(blk, slot, pos);\n"
                   "        if (t0 == 0 && blk + 1 < whi) {  // the next block's K and V into L2\n"
                   "            i64 next; int next_pos;\n"
                   "            entry(blk + 1, next, next_pos);\n"
                   "            if (lane < 2) {\n"
                   "                const signed char* at = p.warm + next * p.s_w_slot + head * p.s_w_head + lane * p.s_w_kv;\n"
                   '                asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(at), "r"(T * D) : "memory");\n'
                   "            }\n"
                   "        }\n"
                   "        const signed char* k_src")


wv.VARIANTS = {
    "base": (lambda s: s, 2, 3, 32),
    "stages3": (lambda s: s, 3, 2, 32),
    "prefetch_l2": (prefetch_l2, 2, 3, 32),
    "both": (prefetch_l2, 3, 2, 32),
}

if __name__ == "__main__":
    wv.main()
