#!/usr/bin/env bash
# Session 14 call 6: the read-only stream of one 1M-token layer's int8 and fp16 bytes against SDPA and the int8 walk
# (read_ceiling.py), then the captured-decode tests again (call 4's run had a NameError in one test, mended).
set -uo pipefail
mkdir -p /tmp/w && rm -rf /tmp/w/* && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=/tmp/res6; mkdir -p $R; cp /tmp/w/REV $R/
save() { tar -czf $OUT/res6.tgz -C /tmp res6; }
cd /tmp/w
for i in 1 2; do timeout 100 python3 bench_longctx/results/h200-session14/read_ceiling.py $R/read$i > $R/read$i.log 2>&1; save; done
timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/engine_adapter/test_graph_decode.py > $R/tests_graph.log 2>&1; save
echo done > $R/DONE; save
