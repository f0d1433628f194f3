#!/usr/bin/env bash
# Session 6, call 3: the layer step at 8K-1M (one-layer stores, and tokens of all 32 layers per layer) against SDPA;
# the verified cpu -> GPU fetch (do_bench and by the host's clock).
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:/tmp/w PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd /tmp/w
R=$OUT/res3; mkdir -p $R; cp REV $R/
KV='from kvstore.cli import main; raise SystemExit(main())'
timeout 330 python3 -c "$KV" bench decode --preset h200 --set decode.contexts=8K,16K,32K,1M --set decode.budgets=4096 --no-plots --out $R/decode > $R/decode.log 2>&1
timeout 150 python3 -m bench_longctx.fetch_bench --out $R/fetch_h200.json > $R/fetch.log 2>&1
cd $OUT && tar -czf res3.tgz res3 && rm -rf res3
