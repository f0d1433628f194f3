#!/usr/bin/env bash
# Session 6, call 6: the final tree's compiled tests: every attention kernel test, DecodeStep, the captured graph tests.
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:/tmp/w PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd /tmp/w
R=$OUT/res6; mkdir -p $R; cp REV $R/
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kvstore/attention tests/kvstore/test_step.py > $R/kernel_tests.log 2>&1
timeout 170 python3 -m pytest -q -p no:cacheprovider -m cuda tests/engine_adapter/test_graph_decode.py tests/engine_adapter/test_gpu_decode.py > $R/graph_tests.log 2>&1
cd $OUT && tar -czf res6.tgz res6 && rm -rf res6
