#!/usr/bin/env bash
# Session 9, call 4: the packed-PTX nibble decode (DECODE 2) in the sketch kernels: compiled sketch tests (incl. DECODE 2
# == DECODE 1 bit for bit) and graph tests; the first level at 1M, decode 1 vs 2 (sketch_bench); e2e 1M sketch this
# tree vs 252818a, same call.
set -uo pipefail
mkdir -p /tmp/w4 /tmp/b4 && tar -xf .snap/head.tar -C /tmp/w4 && cp .snap/rev /tmp/w4/REV && tar -xf .snap/base.tar -C /tmp/b4 && cp .snap/baserev /tmp/b4/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/res4; mkdir -p $R; cp /tmp/w4/REV $R/; cp /tmp/b4/REV $R/BASEREV
KV='from kvstore.cli import main; raise SystemExit(main())'
save() { cd $OUT && tar -czf res4.tgz -C /tmp res4; }
cd /tmp/w4 && PYTHONPATH=/tmp/site:/tmp/w4 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/eviction/test_sketch_channels.py tests/eviction/test_sketch_kernel.py tests/eviction/test_sketch_topk.py tests/kvstore/test_sketch_store.py > $R/tests.log 2>&1
save
SWEEP='[{"blocks_per_program":16,"num_warps":4,"decode":1},{"blocks_per_program":16,"num_warps":4,"decode":2},
{"blocks_per_program":8,"num_warps":4,"decode":1},{"blocks_per_program":8,"num_warps":4,"decode":2},
{"blocks_per_program":16,"num_warps":8,"decode":2},{"blocks_per_program":32,"num_warps":8,"decode":2},{"blocks_per_program":8,"num_warps":2,"decode":2}]'
cd /tmp/w4 && PYTHONPATH=/tmp/site:/tmp/w4 timeout 200 python3 -m bench_longctx.sketch_bench --out $R/sketch --channels 64 --scan-sweep "$SWEEP" > $R/sketch.log 2>&1
save
for t in w4 b4; do cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 60 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=sketch --no-plots --out $R/e2e_$t > $R/e2e_$t.log 2>&1; done
save
cd /tmp/w4 && PYTHONPATH=/tmp/site:/tmp/w4 timeout 90 python3 -m pytest -q -p no:cacheprovider -m cuda tests/engine_adapter/test_graph_decode.py > $R/graph_tests.log 2>&1
save
