#!/usr/bin/env bash
# Session 16, call 1: the partition walk's pools sharing a row's P + 1 partial slots by their work (95152fe) against
# session 15's tree (05d6567, P slots each). GPU tests of the walks (both kernels); walk_mix.py alternated twice;
# mixed_parts.py (session 15's: kernels per graph replay) in both trees.
set -uo pipefail
for t in base head; do mkdir -p /tmp/$t && rm -rf /tmp/$t/* && tar -xf .snap/$t.tar -C /tmp/$t; done
cp .snap/rev /tmp/head/REV; cp .snap/baserev /tmp/base/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/res1; mkdir -p $R; cp /tmp/head/REV $R/REV; cp /tmp/base/REV $R/BASEREV
save() { tar -czf $OUT/res1.tgz -C /tmp res1; }
cp /tmp/head/bench_longctx/results/h200-session16/walk_mix.py /tmp/walk_mix.py
cp /tmp/head/bench_longctx/results/h200-session15/mixed_parts.py /tmp/mixed_parts.py
cd /tmp/head
PYTHONPATH=/tmp/site:/tmp/head timeout 150 python3 -m pytest -q -p no:cacheprovider \
  tests/kvstore/attention/test_partition.py tests/kvstore/attention/test_int8_mma.py \
  tests/kvstore/attention/test_merge_outputs.py > $R/tests.log 2>&1; save
for rep in 1 2; do
  for t in head base; do
    (cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 90 python3 /tmp/walk_mix.py $R/time ${t}$rep) >> $R/time.log 2>&1
    save
  done
done
for t in head base; do
  (cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 60 python3 /tmp/mixed_parts.py $R/mixed_$t) > $R/mixed_$t.log 2>&1
  save
done
echo done > $R/DONE; save
