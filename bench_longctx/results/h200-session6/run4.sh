#!/usr/bin/env bash
# Session 6, call 4: e2e at 1M and 8K (appending decode through Decoder, same tree as call 3), and the 8K dense token's
# kernels after the bucketed dense table and the merge's H2O add.
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:/tmp/w PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd /tmp/w
R=$OUT/res4; mkdir -p $R; cp REV $R/
KV='from kvstore.cli import main; raise SystemExit(main())'
timeout 200 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --no-plots --out $R/e2e1m > $R/e2e1m.log 2>&1
timeout 120 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --set e2e.context=8192 --no-plots --out $R/e2e8k > $R/e2e8k.log 2>&1
timeout 120 python3 -m bench_longctx.step_profile --out $R --context 8192 --mode dense --steps 16 > $R/step_profile_8k_dense.log 2>&1
cd $OUT && tar -czf res4.tgz res4 && rm -rf res4
