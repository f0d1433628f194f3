#!/usr/bin/env bash
# Session 15, call 2: the int8 walk with shared-space addressing, constant strides, L2 prefetch hints, K scales once
# a block, the score scale in the exponent's FMA, l summed per block and the rescale skipped while the max holds.
# walk_time.py alternated between the session-14 tree
# (.snap/base.tar) and this one (.snap/head.tar), then ncu on this tree's walk, then the GPU tests of the attention kernels and the decode step.
set -uo pipefail
for t in base head; do mkdir -p /tmp/$t && rm -rf /tmp/$t/* && tar -xf .snap/$t.tar -C /tmp/$t; done
cp .snap/rev /tmp/head/REV; cp .snap/baserev /tmp/base/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/res2; mkdir -p $R; cp /tmp/head/REV $R/REV; cp /tmp/base/REV $R/BASEREV
save() { tar -czf $OUT/res2.tgz -C /tmp res2; }
S=bench_longctx/results/h200-session15
cp /tmp/head/$S/walk_time.py /tmp/walk_time.py
for rep in 1 2; do
  for t in base head; do
    (cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 100 python3 /tmp/walk_time.py $R/time ${t}$rep) >> $R/time.log 2>&1
    save
  done
done
cd /tmp/head
PYTHONPATH=/tmp/site:/tmp/head timeout 100 ncu --clock-control none --kernel-name regex:int8_split --launch-skip 2 \
  --launch-count 1 --set full -o $R/walk python3 $S/walk_once.py > $R/ncu.log 2>&1
ncu -i $R/walk.ncu-rep --page details --print-details all > $R/ncu_details.txt 2>&1
ncu -i $R/walk.ncu-rep --page source --csv --print-source sass 2>&1 | gzip > $R/ncu_source.csv.gz
rm -f $R/walk.ncu-rep
cd /tmp/head
PYTHONPATH=/tmp/site:/tmp/head timeout 230 python3 -m pytest -q -p no:cacheprovider -m cuda tests/kvstore/attention \
  tests/kvstore/test_step.py tests/kvstore/test_step_dense.py > $R/tests.log 2>&1; save
echo done > $R/DONE; save
