#!/usr/bin/env bash
# Session 9, call 6: the 1M norm-matched needles (sketch_bench, llama3-8b geometry, budget 4096, 64-token blocks) with
# the first level reading its channels in RoPE pairs (pairs/pair_needles.py) against today's top channels, r = 32, 64.
set -uo pipefail
mkdir -p /tmp/w6 && tar -xf .snap/head.tar -C /tmp/w6 && cp .snap/rev /tmp/w6/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w6
R=/tmp/res6; mkdir -p $R; cp /tmp/w6/REV $R/
save() { cd $OUT && tar -czf res6.tgz -C /tmp res6; }
SWEEP='[{"blocks_per_program":16,"num_warps":4}]'
cd /tmp/w6 && timeout 110 python3 bench_longctx/results/h200-session9/pairs/pair_needles.py $R/pairs --channels 32,64 --scan-sweep "$SWEEP" > $R/pairs.log 2>&1
save
cd /tmp/w6 && timeout 110 python3 -m bench_longctx.sketch_bench --out $R/top --channels 32,64 --scan-sweep "$SWEEP" > $R/top.log 2>&1
save
