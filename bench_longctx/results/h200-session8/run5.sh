#!/usr/bin/env bash
# Session 8, call 5: the certify kernel's knob sweep against the torch form at 1M; the int8 tensor-core Q.K^T
# experiment of session 7 (offline/time_q_int8.py) timed against paged_decode's int8 loop and SDPA.
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=$OUT/res5; mkdir -p $R; cp /tmp/w/REV $R/
cd /tmp/w
timeout 120 python3 bench_longctx/results/h200-session8/diag_certify.py > $R/certify.log 2>&1
timeout 150 python3 bench_longctx/results/h200-session7/offline/time_q_int8.py --tokens 1M --out $R/q_int8.json > $R/q_int8.log 2>&1
cd $OUT && tar -czf res5.tgz res5 && rm -rf res5
