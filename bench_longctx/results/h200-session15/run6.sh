#!/usr/bin/env bash
# Session 15, call 6: the merge takes up to 128 splits a step (a partitioned 1M row's 66 were two steps).
# The merge tests on the GPU; walk_time.py in this tree and in call 5's (c606f0e), alternated twice; mixed_parts.py.
set -uo pipefail
for t in base head; do mkdir -p /tmp/$t && rm -rf /tmp/$t/* && tar -xf .snap/$t.tar -C /tmp/$t; done
cp .snap/rev /tmp/head/REV; cp .snap/baserev /tmp/base/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/res6; mkdir -p $R; cp /tmp/head/REV $R/REV; cp /tmp/base/REV $R/BASEREV
save() { tar -czf $OUT/res6.tgz -C /tmp res6; }
S=bench_longctx/results/h200-session15
cp /tmp/head/$S/walk_time.py /tmp/walk_time.py
cd /tmp/head
PYTHONPATH=/tmp/site:/tmp/head timeout 90 python3 -m pytest -q -p no:cacheprovider \
  tests/kvstore/attention/test_merge_outputs.py > $R/tests.log 2>&1; save
for rep in 1 2; do
  for t in head base; do
    (cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 80 python3 /tmp/walk_time.py $R/time ${t}$rep) >> $R/time.log 2>&1
    save
  done
done
cd /tmp/head
PYTHONPATH=/tmp/site:/tmp/head timeout 60 python3 $S/mixed_parts.py $R/mixed > $R/mixed.log 2>&1; save
echo done > $R/DONE; save
