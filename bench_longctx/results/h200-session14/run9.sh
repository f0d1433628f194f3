#!/usr/bin/env bash
# Session 14 call 9: the partition walk's two launches forked onto two streams (overlap_study.py), then the GPU
# tests of the walk with the fork on (partition, int8 CUDA walk, the kept partition in the step).
set -uo pipefail
mkdir -p /tmp/w && rm -rf /tmp/w/* && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=/tmp/res9; mkdir -p $R; cp /tmp/w/REV $R/
save() { tar -czf $OUT/res9.tgz -C /tmp res9; }
cd /tmp/w
timeout 120 python3 bench_longctx/results/h200-session14/overlap_study.py $R/overlap > $R/overlap.log 2>&1; save
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/kvstore/attention/test_partition.py tests/kvstore/attention/test_int8_mma.py tests/kvstore/test_step_dense.py > $R/tests.log 2>&1; save
echo done > $R/DONE; save
