#!/usr/bin/env bash
# Session 8, call 8: the fused final top-k + block table of the sketch selection: compiled top-k / sketch / step
# tests, e2e at 1M this tree vs the session's start (2b6c29c), same call. Results written as they come (no tar).
set -uo pipefail
mkdir -p /tmp/w8 /tmp/b8 && tar -xf .snap/head.tar -C /tmp/w8 && cp .snap/rev /tmp/w8/REV && tar -xf .snap/base.tar -C /tmp/b8 && cp .snap/baserev /tmp/b8/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=$OUT/res8; mkdir -p $R; cp /tmp/w8/REV $R/; cp /tmp/b8/REV $R/BASEREV
KV='from kvstore.cli import main; raise SystemExit(main())'
cd /tmp/w8 && PYTHONPATH=/tmp/site:/tmp/w8 timeout 60 python3 -m pytest -q -p no:cacheprovider tests/eviction/test_topk_kernel.py tests/eviction/test_sketch_topk.py tests/kvstore/test_step.py > $R/tests.log 2>&1
cd /tmp/w8 && PYTHONPATH=/tmp/site:/tmp/w8 timeout 60 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=sketch,topk --no-plots --out $R/e2e1m > $R/e2e1m.log 2>&1
cd /tmp/b8 && PYTHONPATH=/tmp/site:/tmp/b8 timeout 60 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=sketch,topk --no-plots --out $R/e2e1m_base > $R/e2e1m_base.log 2>&1
