#!/usr/bin/env bash
# Session 11, call 1: session 10's unverified work compiled on the H200: the per-chunk partition scan and the
# int8_mma host mends (attention tests), then int8_bench --quick and e2e dense this tree vs aa0124a (the
# single-program partition scan), same call.
set -uo pipefail
mkdir -p /tmp/w /tmp/b && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV && tar -xf .snap/base.tar -C /tmp/b && cp .snap/baserev /tmp/b/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/res1; mkdir -p $R; cp /tmp/w/REV $R/; cp /tmp/b/REV $R/BASEREV
save() { tar -czf $OUT/res1.tgz -C /tmp res1; }
KV='from kvstore.cli import main; raise SystemExit(main())'
cd /tmp/w && PYTHONPATH=/tmp/site:/tmp/w timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kvstore/attention > $R/tests_attention.log 2>&1; save
for t in w b; do cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 100 python3 -m bench_longctx.int8_bench --quick --out $R/int8_$t > $R/int8_$t.log 2>&1; save; done
for t in w b; do cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 60 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=dense,sketch --no-plots --out $R/e2e_$t > $R/e2e_$t.log 2>&1; save; done
echo done > $R/DONE; save
