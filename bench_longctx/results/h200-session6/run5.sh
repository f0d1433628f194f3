#!/usr/bin/env bash
# Session 6, call 5: e2e at 1M and 8K, this tree (call 3-4's) against e4ce5d8 (the session's start) in the same run.
set -uo pipefail
for t in new old; do mkdir -p /tmp/$t && tar -xf .snap/$([ $t = new ] && echo head || echo old).tar -C /tmp/$t; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=$OUT/res5; mkdir -p $R; cp .snap/rev $R/REV_new; echo e4ce5d8 > $R/REV_old
KV='from kvstore.cli import main; raise SystemExit(main())'
for t in old new; do
  (cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 150 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --no-plots --out $R/e2e1m_$t > $R/e2e1m_$t.log 2>&1)
  (cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 80 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --set e2e.context=8192 --no-plots --out $R/e2e8k_$t > $R/e2e8k_$t.log 2>&1)
done
cd $OUT && tar -czf res5.tgz res5 && rm -rf res5
