#!/usr/bin/env bash
# Session 17, call 3: the CUDA-marked tests on the final tree (call 2's 150 s cap stopped them after 36).
set -uo pipefail
mkdir -p /tmp/head && rm -rf /tmp/head/* && tar -xf .snap/head.tar -C /tmp/head; cp .snap/rev /tmp/head/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/res3; rm -rf $R; mkdir -p $R; cp /tmp/head/REV $R/REV
save() { tar -czf $OUT/res3.tgz -C /tmp res3; }
cd /tmp/head
PYTHONPATH=/tmp/site:/tmp/head timeout 480 python3 -m pytest -q -p no:cacheprovider -m cuda tests --ignore=tests/kvstore/service -rs --durations=10 > $R/tests.log 2>&1; echo "rc $?" >> $R/tests.log; save
echo done > $R/DONE; save
