#!/usr/bin/env bash
# Session 11, call 6: ring depth x programs per SM x persistence of the CUDA sketch first level (graph-replayed at 1M).
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=/tmp/res6; mkdir -p $R; cp /tmp/w/REV $R/
save() { tar -czf $OUT/res6.tgz -C /tmp res6; }
cd /tmp/w
timeout 200 python3 bench_longctx/results/h200-session11/variants.py $R/variants.json > $R/variants.log 2>&1; save
echo done > $R/DONE; save
