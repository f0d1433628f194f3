#!/usr/bin/env bash
# Session 16, call 7: walk_variants3.py (the int8 walk's V decode in fewer instructions), 1M, llama3-8b, block 64.
set -uo pipefail
mkdir -p /tmp/head && rm -rf /tmp/head/* && tar -xf .snap/head.tar -C /tmp/head
cp .snap/rev /tmp/head/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/head
R=/tmp/res7; mkdir -p $R; cp /tmp/head/REV $R/REV
save() { tar -czf $OUT/res7.tgz -C /tmp res7; }
cd /tmp/head
timeout 200 python3 bench_longctx/results/h200-session16/walk_variants3.py $R/variants3 > $R/variants3.log 2>&1; save
echo done > $R/DONE; save
