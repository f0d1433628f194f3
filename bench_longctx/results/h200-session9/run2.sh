#!/usr/bin/env bash
# Session 9, call 2: the fused append stored before the tile's loads: compiled tests; the layer step
# (kvtier bench decode 8K-32K) this tree vs session 8's end (252818a), same call. Results in one tar.
set -uo pipefail
mkdir -p /tmp/w2 /tmp/b2 && tar -xf .snap/head.tar -C /tmp/w2 && cp .snap/rev /tmp/w2/REV && tar -xf .snap/base.tar -C /tmp/b2 && cp .snap/baserev /tmp/b2/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/res2; mkdir -p $R; cp /tmp/w2/REV $R/; cp /tmp/b2/REV $R/BASEREV
KV='from kvstore.cli import main; raise SystemExit(main())'
for t in w2 b2 w2 b2; do cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 100 python3 -c "$KV" bench decode --preset h200 --set decode.contexts=8K,16K,32K --set decode.budgets=4096 --no-plots --out $R/decode_${t}_$RANDOM > $R/decode_$t.$RANDOM.log 2>&1; done
cd $OUT && tar -czf res2a.tgz -C /tmp res2
cd /tmp/w2 && PYTHONPATH=/tmp/site:/tmp/w2 timeout 170 python3 -m pytest -q -p no:cacheprovider tests/kvstore/attention/test_append.py tests/kvstore/attention/test_one_tile.py tests/eviction/test_topk_kernel.py tests/eviction/test_sketch_topk.py tests/kvstore/test_step.py tests/kvstore/test_sketch_store.py > $R/tests.log 2>&1
cd /tmp/w2 && PYTHONPATH=/tmp/site:/tmp/w2 timeout 120 python3 -m pytest -q -p no:cacheprovider -m cuda tests/engine_adapter/test_graph_decode.py > $R/graph_tests.log 2>&1
cd $OUT && tar -czf res2.tgz -C /tmp res2 && rm -f res2a.tgz
