#!/usr/bin/env bash
# Session 9, call 3: the append inside the attention launch in the dense and topk phases: compiled step / graph
# tests; layer step 8K-1M; e2e at 8K (dense, topk) and 1M (topk, dense int8): this tree vs 252818a, same call.
set -uo pipefail
mkdir -p /tmp/w3 /tmp/b3 && tar -xf .snap/head.tar -C /tmp/w3 && cp .snap/rev /tmp/w3/REV && tar -xf .snap/base.tar -C /tmp/b3 && cp .snap/baserev /tmp/b3/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/res3; mkdir -p $R; cp /tmp/w3/REV $R/; cp /tmp/b3/REV $R/BASEREV
KV='from kvstore.cli import main; raise SystemExit(main())'
save() { cd $OUT && tar -czf res3.tgz -C /tmp res3; }
cd /tmp/w3 && PYTHONPATH=/tmp/site:/tmp/w3 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kvstore/attention/test_append.py tests/kvstore/test_step.py > $R/tests.log 2>&1
cd /tmp/w3 && PYTHONPATH=/tmp/site:/tmp/w3 timeout 100 python3 -m pytest -q -p no:cacheprovider -m cuda tests/engine_adapter/test_graph_decode.py > $R/graph_tests.log 2>&1
save
for t in w3 b3; do cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 60 python3 -c "$KV" bench e2e --preset h200 --set e2e.context=8192 --set e2e.steps=256 --set e2e.modes=dense,topk --no-plots --out $R/e2e8k_$t > $R/e2e8k_$t.log 2>&1; done
save
for t in w3 b3; do cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 80 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=topk,dense --no-plots --out $R/e2e1m_$t > $R/e2e1m_$t.log 2>&1; done
save
for t in w3 b3; do cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 110 python3 -c "$KV" bench decode --preset h200 --set decode.contexts=8K,16K,32K,1M --set decode.budgets=4096 --no-plots --out $R/decode_$t > $R/decode_$t.log 2>&1; done
save
