#!/usr/bin/env bash
# Session 8, call 6: the final tree (certify kernel's new default): compiled certify / sketch-store tests, e2e at 1M
# vs the session's start (2b6c29c), same call.
set -uo pipefail
mkdir -p /tmp/w6 /tmp/b6 && tar -xf .snap/head.tar -C /tmp/w6 && cp .snap/rev /tmp/w6/REV && tar -xf .snap/base.tar -C /tmp/b6 && cp .snap/baserev /tmp/b6/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=$OUT/res6; mkdir -p $R; cp /tmp/w6/REV $R/; cp /tmp/b6/REV $R/BASEREV
KV='from kvstore.cli import main; raise SystemExit(main())'
cd /tmp/w6 && PYTHONPATH=/tmp/site:/tmp/w6 timeout 90 python3 -m pytest -q -p no:cacheprovider tests/eviction/test_certify.py tests/kvstore/test_sketch_store.py > $R/tests.log 2>&1
cd /tmp/w6 && PYTHONPATH=/tmp/site:/tmp/w6 timeout 90 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --no-plots --out $R/e2e1m > $R/e2e1m.log 2>&1
cd /tmp/b6 && PYTHONPATH=/tmp/site:/tmp/b6 timeout 90 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --no-plots --out $R/e2e1m_base > $R/e2e1m_base.log 2>&1
cd $OUT && tar -czf res6.tgz res6 && rm -rf res6
