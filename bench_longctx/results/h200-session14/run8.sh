#!/usr/bin/env bash
# Session 14 call 8: the int8 walk against a gather of exactly its bytes and a flat read of as many, over a random
# and an in-order table (gather_ceiling.py), twice; then int8_bench --quick with its first_cooled case (a long fp16
# table whose oldest 1/64 of blocks are int8).
set -uo pipefail
mkdir -p /tmp/w && rm -rf /tmp/w/* && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=/tmp/res8; mkdir -p $R; cp /tmp/w/REV $R/
save() { tar -czf $OUT/res8.tgz -C /tmp res8; }
cd /tmp/w
for i in 1 2; do timeout 150 python3 bench_longctx/results/h200-session14/gather_ceiling.py $R/gather$i > $R/gather$i.log 2>&1; save; done
timeout 170 python3 -m bench_longctx.int8_bench --quick --out $R/int8 > $R/int8.log 2>&1; save
echo done > $R/DONE; save
