#!/usr/bin/env bash
# Session 12, call 4: where a 1M dense int8 token's GPU time goes (step_profile --mode dense)
set -uo pipefail
mkdir -p /tmp/w && rm -rf /tmp/w/* && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=/tmp/res4; mkdir -p $R; cp /tmp/w/REV $R/
save() { tar -czf $OUT/res4.tgz -C /tmp res4; }
cd /tmp/w
timeout 200 python3 -m bench_longctx.step_profile --out $R/prof --mode dense --steps 8 > $R/prof_dense.log 2>&1; save
true
echo done > $R/DONE; save
