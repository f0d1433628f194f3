#!/usr/bin/env bash
# Session 9, call 1: compiled tests of session 8's unverified mends and of the fused append; the layer step
# (kvtier bench decode 8K-32K) and e2e at 1M (sketch, topk), this tree vs session 8's end (252818a), same call.
set -uo pipefail
mkdir -p /tmp/w /tmp/b && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV && tar -xf .snap/base.tar -C /tmp/b && cp .snap/baserev /tmp/b/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=$OUT/res1; mkdir -p $R; cp /tmp/w/REV $R/; cp /tmp/b/REV $R/BASEREV
KV='from kvstore.cli import main; raise SystemExit(main())'
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $R/gpu.txt 2>&1
cd /tmp/w && PYTHONPATH=/tmp/site:/tmp/w timeout 170 python3 -m pytest -q -p no:cacheprovider tests/kvstore/attention/test_append.py tests/kvstore/attention/test_one_tile.py tests/eviction/test_topk_kernel.py tests/eviction/test_sketch_topk.py tests/kvstore/test_step.py tests/kvstore/test_sketch_store.py > $R/tests.log 2>&1
cd /tmp/w && PYTHONPATH=/tmp/site:/tmp/w timeout 120 python3 -m pytest -q -p no:cacheprovider -m cuda tests/engine_adapter/test_graph_decode.py > $R/graph_tests.log 2>&1
for t in w b; do cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 100 python3 -c "$KV" bench decode --preset h200 --set decode.contexts=8K,16K,32K --set decode.budgets=4096 --no-plots --out $R/decode_$t > $R/decode_$t.log 2>&1; done
for t in w b; do cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 75 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=sketch,topk --no-plots --out $R/e2e_$t > $R/e2e_$t.log 2>&1; done
echo done > $R/DONE
