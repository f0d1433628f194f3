#!/usr/bin/env bash
# Session 12, call 10: the final tree's numbers: sketch_bench (needles, first level, selection), e2e all modes at 1M,
# e2e sketch of the session's starting tree (fab631a) and of the final tree again, same call.
set -uo pipefail
for t in w:head b:base; do d=/tmp/${t%%:*}; mkdir -p $d && rm -rf $d/* && tar -xf .snap/${t##*:}.tar -C $d; done
cp .snap/rev /tmp/w/REV; cp .snap/baserev /tmp/b/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/res10; mkdir -p $R; cp /tmp/w/REV $R/; cp /tmp/b/REV $R/BASEREV
save() { tar -czf $OUT/res10.tgz -C /tmp res10; }
KV='from kvstore.cli import main; raise SystemExit(main())'
cd /tmp/w
PYTHONPATH=/tmp/site:/tmp/w timeout 200 python3 -m bench_longctx.sketch_bench --channels 64 --out $R/sketch > $R/sketch.log 2>&1; save
PYTHONPATH=/tmp/site:/tmp/w timeout 120 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --no-plots --out $R/e2e_head > $R/e2e_head.log 2>&1; save
cd /tmp/b
PYTHONPATH=/tmp/site:/tmp/b timeout 80 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=sketch --no-plots --out $R/e2e_base > $R/e2e_base.log 2>&1; save
cd /tmp/w
PYTHONPATH=/tmp/site:/tmp/w timeout 80 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=sketch --no-plots --out $R/e2e_head2 > $R/e2e_head2.log 2>&1; save
echo done > $R/DONE; save
