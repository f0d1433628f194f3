#!/usr/bin/env bash
# Session 6, call 2: compiled tests of the merge's H2O add, the bucketed dense table and the int8 loops (graph tests
# included); the layer step at 8K-1M against SDPA; the int8 loops (tile, folded, prefetch) at 1M.
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:/tmp/w PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd /tmp/w
R=$OUT/res2; mkdir -p $R; cp REV $R/
KV='from kvstore.cli import main; raise SystemExit(main())'
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kvstore/attention/test_paged_decode.py tests/kvstore/attention/test_partition.py -k "mass_added or int8_loop" > $R/unit_tests.log 2>&1
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kvstore/test_step.py >> $R/unit_tests.log 2>&1
timeout 170 python3 -m pytest -q -p no:cacheprovider -m cuda tests/engine_adapter/test_graph_decode.py > $R/graph_tests.log 2>&1
timeout 90 python3 -c "$KV" bench decode --preset h200 --set decode.contexts=8K,16K,32K,1M --set decode.budgets=4096 --no-plots --out $R/decode > $R/decode.log 2>&1
timeout 150 python3 -m bench_longctx.int8_bench --loops --out $R > $R/int8_loops.log 2>&1
cd $OUT && tar -czf res2.tgz res2 && rm -rf res2
