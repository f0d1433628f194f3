#!/usr/bin/env bash
# Session 6, call 1: compiled partition tests (folded int8 loop included), the two int8 loops at 1M, the 8K dense
# step's kernels, and where the verified int8 fetch's time goes.
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV && cp .snap/diag_fetch.py /tmp/w/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:/tmp/w PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd /tmp/w
R=$OUT/res1; mkdir -p $R; cp REV diag_fetch.py $R/
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kvstore/attention/test_partition.py > $R/partition_tests.log 2>&1
timeout 240 python3 -m bench_longctx.int8_bench --loops --out $R > $R/int8_loops.log 2>&1
timeout 90 python3 diag_fetch.py > $R/diag_fetch.log 2>&1
timeout 120 python3 -m bench_longctx.step_profile --out $R --context 8192 --mode dense --steps 16 > $R/step_profile_8k_dense.log 2>&1
cd $OUT && tar -czf res1.tgz res1 && rm -rf res1
