#!/usr/bin/env bash
# Session 7, call 4: diag_pool_loops.py (int8 loop tile and splits per walk); the compiled attention and step tests.
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:/tmp/w PYTHONUNBUFFERED=1
cd /tmp/w
R=$OUT/res4; mkdir -p $R; cp REV $R/
timeout 200 python3 bench_longctx/results/h200-session7/diag_pool_loops.py $R/pool_loops.json > $R/pool_loops.log 2>&1
timeout 220 python3 -m pytest -q -p no:cacheprovider tests/kvstore/attention tests/kvstore/test_step.py > $R/tests.log 2>&1
cd $OUT && tar -czf res4.tgz res4 && rm -rf res4
