#!/usr/bin/env bash
# Session 12, call 11: sketch_bench with its stages graph-timed and the selection on the default fine pass.
set -uo pipefail
mkdir -p /tmp/w && rm -rf /tmp/w/* && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=/tmp/res11; mkdir -p $R; cp /tmp/w/REV $R/
save() { tar -czf $OUT/res11.tgz -C /tmp res11; }
cd /tmp/w
timeout 220 python3 -m bench_longctx.sketch_bench --channels 64 --out $R/sketch > $R/sketch.log 2>&1; save
echo done > $R/DONE; save
