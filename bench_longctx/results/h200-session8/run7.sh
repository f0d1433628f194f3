#!/usr/bin/env bash
# Session 8, call 7: the final tree's compiled tests: the captured decode through Decoder (-m cuda graph tests),
# every eviction test, the sketch store and the decode step.
set -uo pipefail
mkdir -p /tmp/w7 && tar -xf .snap/head.tar -C /tmp/w7 && cp .snap/rev /tmp/w7/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w7
R=$OUT/res7; mkdir -p $R; cp /tmp/w7/REV $R/
cd /tmp/w7
timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests/engine_adapter/test_graph_decode.py > $R/graph_tests.log 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/eviction tests/kvstore/test_sketch_store.py tests/kvstore/test_step.py > $R/tests.log 2>&1
cd $OUT && tar -czf res7.tgz res7 && rm -rf res7
