#!/usr/bin/env bash
# Session 7, call 2: the int8 and fp16 split loops at 1M over tile, warps, stages and split count (diag_int8_sweep.py).
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:/tmp/w PYTHONUNBUFFERED=1
cd /tmp/w
R=$OUT/res2; mkdir -p $R; cp REV $R/
timeout 400 python3 bench_longctx/results/h200-session7/diag_int8_sweep.py $R/int8_sweep.json > $R/int8_sweep.log 2>&1
cd $OUT && tar -czf res2.tgz res2 && rm -rf res2
