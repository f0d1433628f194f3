#!/usr/bin/env bash
# Session 15, call 3: the partition walk's int8 launch made programmatic (it may start while the fp16 launch's last
# programs run). GPU tests; walk_time.py in this tree with it on and off (KVTIER_PDL=0) and in the session-14 tree,
# alternated twice; mixed_parts.py (kernels per graph replay); int8_bench --quick (the benchmark's own table).
set -uo pipefail
for t in base head; do mkdir -p /tmp/$t && rm -rf /tmp/$t/* && tar -xf .snap/$t.tar -C /tmp/$t; done
cp .snap/rev /tmp/head/REV; cp .snap/baserev /tmp/base/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/res3; mkdir -p $R; cp /tmp/head/REV $R/REV; cp /tmp/base/REV $R/BASEREV
save() { tar -czf $OUT/res3.tgz -C /tmp res3; }
S=bench_longctx/results/h200-session15
cp /tmp/head/$S/walk_time.py /tmp/walk_time.py
cd /tmp/head
PYTHONPATH=/tmp/site:/tmp/head timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/kvstore/attention \
  tests/kvcuda tests/kvstore/test_step.py tests/kvstore/test_step_dense.py tests/engine_adapter/test_graph_decode.py \
  > $R/tests.log 2>&1; save
for rep in 1 2; do
  for t in head_pdl head_nopdl base; do
    dir=/tmp/${t%%_*}; pdl=1; [ $t = head_nopdl ] && pdl=0
    (cd $dir && KVTIER_PDL=$pdl PYTHONPATH=/tmp/site:$dir timeout 100 python3 /tmp/walk_time.py $R/time ${t}$rep) >> $R/time.log 2>&1
    save
  done
done
cd /tmp/head
PYTHONPATH=/tmp/site:/tmp/head timeout 100 python3 $S/mixed_parts.py $R/mixed > $R/mixed.log 2>&1; save
PYTHONPATH=/tmp/site:/tmp/head timeout 170 python3 -m bench_longctx.int8_bench --quick --out $R/int8 > $R/int8.log 2>&1; save
echo done > $R/DONE; save
