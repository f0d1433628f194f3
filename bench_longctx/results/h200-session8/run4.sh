#!/usr/bin/env bash
# Session 8, call 4: the certified omitted mass in one launch per layer: compiled certify / sketch-store / step
# tests; e2e at 1M this tree vs the session's start (2b6c29c), same call; where a captured sketch token's time goes.
set -uo pipefail
mkdir -p /tmp/w /tmp/b && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV && tar -xf .snap/base.tar -C /tmp/b && cp .snap/baserev /tmp/b/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=$OUT/res4; mkdir -p $R; cp /tmp/w/REV $R/; cp /tmp/b/REV $R/BASEREV
KV='from kvstore.cli import main; raise SystemExit(main())'
cd /tmp/w && PYTHONPATH=/tmp/site:/tmp/w timeout 120 python3 -m pytest -q -p no:cacheprovider tests/eviction/test_certify.py tests/kvstore/test_sketch_store.py tests/kvstore/test_step.py > $R/tests.log 2>&1
cd /tmp/w && PYTHONPATH=/tmp/site:/tmp/w timeout 90 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --no-plots --out $R/e2e1m > $R/e2e1m.log 2>&1
cd /tmp/b && PYTHONPATH=/tmp/site:/tmp/b timeout 90 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --no-plots --out $R/e2e1m_base > $R/e2e1m_base.log 2>&1
cd /tmp/w && PYTHONPATH=/tmp/site:/tmp/w timeout 100 python3 -m bench_longctx.step_profile --out $R/profile --mode sketch --steps 8 > $R/profile.log 2>&1
cd $OUT && tar -czf res4.tgz res4 && rm -rf res4
