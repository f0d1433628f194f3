#!/usr/bin/env bash
# Session 6, call 8 (and 9, after the tier codes became the flags): the final tree: compiled DecodeStep and graph tests, then the layer step at 8K-1M against SDPA.
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:/tmp/w PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd /tmp/w
R=$OUT/res9; mkdir -p $R; cp REV $R/
KV='from kvstore.cli import main; raise SystemExit(main())'
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kvstore/test_step.py > $R/step_tests.log 2>&1
timeout 120 python3 -m pytest -q -p no:cacheprovider -m cuda tests/engine_adapter/test_graph_decode.py tests/engine_adapter/test_gpu_decode.py > $R/graph_tests.log 2>&1
timeout 150 python3 -c "$KV" bench decode --preset h200 --set decode.contexts=8K,16K,32K,1M --set decode.budgets=4096 --no-plots --out $R/decode > $R/decode.log 2>&1
cd $OUT && tar -czf res9.tgz res9 && rm -rf res9
