#!/usr/bin/env bash
# Session 14 call 4: the GPU tests of the kept dense partition (kvstore/step_dense.py; the step's kernel reads a
# partition made at begin_token; a captured 20K-token dense decode over a mixed table), then int8_bench --quick
# with the partition_kept variant (the partition walk without its partition launches) beside the others.
set -uo pipefail
mkdir -p /tmp/w && rm -rf /tmp/w/* && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=/tmp/res4; mkdir -p $R; cp /tmp/w/REV $R/
save() { tar -czf $OUT/res4.tgz -C /tmp res4; }
cd /tmp/w
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kvstore/test_step_dense.py tests/kvstore/test_step.py tests/kvstore/attention/test_partition.py > $R/tests_step.log 2>&1; save
timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests/engine_adapter/test_graph_decode.py > $R/tests_graph.log 2>&1; save
timeout 150 python3 -m bench_longctx.int8_bench --quick --out $R/int8 > $R/int8.log 2>&1; save
echo done > $R/DONE; save
