#!/usr/bin/env bash
# Session 10, call 4: 6 warps a program (this tree) vs 4 (call 3's tree, base), same call: int8 CUDA tests,
# int8_bench --quick, e2e dense at 1M; then session 9's mends compiled: attention, step, sketch-store and graph tests.
set -uo pipefail
mkdir -p /tmp/w /tmp/b && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV && tar -xf .snap/base.tar -C /tmp/b && cp .snap/baserev /tmp/b/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVTIER_INT8_MMA=1
R=/tmp/res4; mkdir -p $R; cp /tmp/w/REV $R/; cp /tmp/b/REV $R/BASEREV
save() { tar -czf $OUT/res4.tgz -C /tmp res4; }
KV='from kvstore.cli import main; raise SystemExit(main())'
cd /tmp/w && PYTHONPATH=/tmp/site:/tmp/w timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests/kvstore/attention/test_int8_mma.py -x > $R/t_int8.log 2>&1; save
for t in w b; do cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 120 python3 -m bench_longctx.int8_bench --quick --out $R/int8_$t > $R/int8_$t.log 2>&1; save; done
for t in w b; do cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 75 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=dense --no-plots --out $R/e2e_$t > $R/e2e_$t.log 2>&1; save; done
cd /tmp/w && PYTHONPATH=/tmp/site:/tmp/w timeout 290 python3 -m pytest -q -p no:cacheprovider tests/kvstore/attention tests/kvstore/test_step.py tests/kvstore/test_sketch_store.py > $R/tests.log 2>&1; save
cd /tmp/w && PYTHONPATH=/tmp/site:/tmp/w timeout 70 python3 -m pytest -q -p no:cacheprovider -m cuda tests/engine_adapter/test_graph_decode.py > $R/graph_tests.log 2>&1
echo done > $R/DONE; save
