#!/usr/bin/env bash
# Session 11, call 7: where the CUDA sketch first level spends its time (diagnostics that drop parts).
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=/tmp/res7; mkdir -p $R; cp /tmp/w/REV $R/
save() { tar -czf $OUT/res7.tgz -C /tmp res7; }
cd /tmp/w
timeout 200 python3 bench_longctx/results/h200-session11/variants.py $R/variants.json > $R/variants.log 2>&1; save
echo done > $R/DONE; save
