#!/usr/bin/env bash
# Session 11, call 9: the final tree compiled on the H200: the int8 kernel after the kvcuda refactor, the CUDA sketch
# first level, the captured step / sketch store / graph decode tests with it in the path, e2e all modes at 1M.
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=/tmp/res9; mkdir -p $R; cp /tmp/w/REV $R/
save() { tar -czf $OUT/res9.tgz -C /tmp res9; }
KV='from kvstore.cli import main; raise SystemExit(main())'
cd /tmp/w
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kvstore/attention/test_int8_mma.py tests/eviction/test_sketch_mma.py tests/kvcuda > $R/tests_kernels.log 2>&1; save
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kvstore/test_step.py tests/kvstore/test_sketch_store.py > $R/tests_step.log 2>&1; save
timeout 70 python3 -m pytest -q -p no:cacheprovider -m cuda tests/engine_adapter/test_graph_decode.py > $R/tests_graph.log 2>&1; save
timeout 70 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --no-plots --out $R/e2e > $R/e2e.log 2>&1; save
echo done > $R/DONE; save
