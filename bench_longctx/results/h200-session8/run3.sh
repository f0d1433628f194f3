#!/usr/bin/env bash
# Session 8, call 3: the merge with hoisted score loads and one step for up to 128 splits: decode per layer at
# 8K-32K (and 1M) this tree vs the session's start (2b6c29c) in the same call; a one-tile size sweep of the dense
# step at 8K/16K; compiled attention and step tests.
set -uo pipefail
mkdir -p /tmp/w /tmp/b && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV && tar -xf .snap/base.tar -C /tmp/b && cp .snap/baserev /tmp/b/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=$OUT/res3; mkdir -p $R; cp /tmp/w/REV $R/; cp /tmp/b/REV $R/BASEREV
KV='from kvstore.cli import main; raise SystemExit(main())'
for i in 1 2; do
cd /tmp/w && PYTHONPATH=/tmp/site:/tmp/w timeout 60 python3 -c "$KV" bench decode --preset h200 --set decode.contexts=8K,16K,32K --set decode.budgets=4096 --no-plots --out $R/decode$i > $R/decode$i.log 2>&1
cd /tmp/b && PYTHONPATH=/tmp/site:/tmp/b timeout 60 python3 -c "$KV" bench decode --preset h200 --set decode.contexts=8K,16K,32K --set decode.budgets=4096 --no-plots --out $R/decode_base$i > $R/decode_base$i.log 2>&1
done
cd /tmp/w && export PYTHONPATH=/tmp/site:/tmp/w
timeout 80 python3 bench_longctx/results/h200-session8/diag_dense_tile.py > $R/dense_tile.log 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kvstore/attention tests/kvstore/test_step.py > $R/tests.log 2>&1
cd $OUT && tar -czf res3.tgz res3 && rm -rf res3
