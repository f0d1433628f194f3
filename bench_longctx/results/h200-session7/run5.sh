#!/usr/bin/env bash
# Session 7, call 5: the final split plan (128-token tiles, balanced at 2 per SM): e2e at 1M this tree vs the
# session's start (6655b3f) in the same call; int8_bench --quick; decode per layer; compiled attention and step tests.
set -uo pipefail
mkdir -p /tmp/w /tmp/b && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV && tar -xf .snap/base.tar -C /tmp/b && cp .snap/baserev /tmp/b/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:/tmp/w PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd /tmp/w
R=$OUT/res5; mkdir -p $R; cp REV $R/; cp /tmp/b/REV $R/BASEREV
KV='from kvstore.cli import main; raise SystemExit(main())'
timeout 80 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --no-plots --out $R/e2e1m > $R/e2e1m.log 2>&1
(cd /tmp/b && PYTHONPATH=/tmp/site:/tmp/b timeout 80 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --no-plots --out $R/e2e1m_base > $R/e2e1m_base.log 2>&1)
timeout 80 python3 -m bench_longctx.int8_bench --quick --out $R/int8 > $R/int8.log 2>&1
timeout 60 python3 -c "$KV" bench decode --preset h200 --set decode.contexts=8K,32K,1M --set decode.budgets=4096 --no-plots --out $R/decode > $R/decode.log 2>&1
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/kvstore/attention tests/kvstore/test_step.py > $R/tests.log 2>&1
cd $OUT && tar -czf res5.tgz res5 && rm -rf res5
