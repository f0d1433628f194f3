#!/usr/bin/env bash
# Session 14 call 7: the CUDA int8 walk's grid swept at 1M (sweep_int8_splits.py), twice.
set -uo pipefail
mkdir -p /tmp/w && rm -rf /tmp/w/* && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=/tmp/res7; mkdir -p $R; cp /tmp/w/REV $R/
save() { tar -czf $OUT/res7.tgz -C /tmp res7; }
cd /tmp/w
for i in 1 2; do timeout 120 python3 bench_longctx/results/h200-session14/sweep_int8_splits.py $R/sweep$i > $R/sweep$i.log 2>&1; save; done
echo done > $R/DONE; save
