#!/usr/bin/env bash
# Session 12, call 8: the selection's small launches (select_study.py)
set -uo pipefail
mkdir -p /tmp/w && rm -rf /tmp/w/* && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=/tmp/res8; mkdir -p $R; cp /tmp/w/REV $R/
save() { tar -czf $OUT/res8.tgz -C /tmp res8; }
cd /tmp/w
timeout 120 python3 bench_longctx/results/h200-session12/select_study.py $R/select.json > $R/select.log 2>&1; save
true
echo done > $R/DONE; save
