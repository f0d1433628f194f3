#!/usr/bin/env bash
# Session 12, call 6: the ascending channel plan on the H200: kernel tests, sketch_bench (needles, first level),
# e2e at 1M with the session's starting tree (fab631a) as the same-call baseline.
set -uo pipefail
for t in w:head b:base; do d=/tmp/${t%%:*}; mkdir -p $d && rm -rf $d/* && tar -xf .snap/${t##*:}.tar -C $d; done
cp .snap/rev /tmp/w/REV; cp .snap/baserev /tmp/b/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/res6; mkdir -p $R; cp /tmp/w/REV $R/; cp /tmp/b/REV $R/BASEREV
save() { tar -czf $OUT/res6.tgz -C /tmp res6; }
KV='from kvstore.cli import main; raise SystemExit(main())'
cd /tmp/w
PYTHONPATH=/tmp/site:/tmp/w timeout 200 python3 -m pytest -q -p no:cacheprovider tests/eviction/test_sketch_mma.py tests/eviction/test_sketch_channels.py tests/kvcuda > $R/tests_kernels.log 2>&1; save
PYTHONPATH=/tmp/site:/tmp/w timeout 200 python3 -m bench_longctx.sketch_bench --channels 64 --out $R/sketch > $R/sketch.log 2>&1; save
PYTHONPATH=/tmp/site:/tmp/w timeout 150 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --no-plots --out $R/e2e_head > $R/e2e_head.log 2>&1; save
cd /tmp/b
PYTHONPATH=/tmp/site:/tmp/b timeout 100 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=sketch --no-plots --out $R/e2e_base > $R/e2e_base.log 2>&1; save
cd /tmp/w
PYTHONPATH=/tmp/site:/tmp/w timeout 100 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=sketch --no-plots --out $R/e2e_head2 > $R/e2e_head2.log 2>&1; save
echo done > $R/DONE; save
