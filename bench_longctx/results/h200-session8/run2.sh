#!/usr/bin/env bash
# Session 8, call 2: e2e at 1M, this tree (persistent sketch first level) vs the session's start (2b6c29c) and vs
# e5d5aa2 (before the kernel's lse_out fed the sketch certificate), same call; where a dense 8K token's time goes
# (step_profile); compiled sketch tests with the new default.
set -uo pipefail
mkdir -p /tmp/w /tmp/b /tmp/b2 && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
tar -xf .snap/base.tar -C /tmp/b && cp .snap/baserev /tmp/b/REV && tar -xf .snap/base2.tar -C /tmp/b2 && cp .snap/base2rev /tmp/b2/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=$OUT/res2; mkdir -p $R; cp /tmp/w/REV $R/; cp /tmp/b/REV $R/BASEREV; cp /tmp/b2/REV $R/BASE2REV
KV='from kvstore.cli import main; raise SystemExit(main())'
cd /tmp/w && PYTHONPATH=/tmp/site:/tmp/w timeout 90 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --no-plots --out $R/e2e1m > $R/e2e1m.log 2>&1
cd /tmp/b && PYTHONPATH=/tmp/site:/tmp/b timeout 90 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --no-plots --out $R/e2e1m_base > $R/e2e1m_base.log 2>&1
cd /tmp/b2 && PYTHONPATH=/tmp/site:/tmp/b2 timeout 90 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --no-plots --out $R/e2e1m_base2 > $R/e2e1m_base2.log 2>&1
cd /tmp/w && export PYTHONPATH=/tmp/site:/tmp/w
timeout 90 python3 -m bench_longctx.step_profile --out $R/profile8k --mode dense --context 8192 --steps 16 > $R/profile8k.log 2>&1
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/eviction/test_sketch_channels.py tests/eviction/test_sketch_topk.py tests/kvstore/test_step.py > $R/tests.log 2>&1
cd $OUT && tar -czf res2.tgz res2 && rm -rf res2
