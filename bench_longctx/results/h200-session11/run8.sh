#!/usr/bin/env bash
# Session 11, call 8: channels read in adjacent pairs: GPU tests, variants at 1M, sketch_bench (needles at 1M, single
# channels and pairs), e2e sketch with the default policy and with channel_pairs=True (e2e_pairs.py), same call.
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=/tmp/res8; mkdir -p $R; cp /tmp/w/REV $R/
save() { tar -czf $OUT/res8.tgz -C /tmp res8; }
KV='from kvstore.cli import main; raise SystemExit(main())'
cd /tmp/w
timeout 100 python3 bench_longctx/results/h200-session11/variants.py $R/variants.json > $R/variants.log 2>&1; save
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/eviction/test_sketch_mma.py tests/eviction/test_sketch_channels.py -k "pairs or cuda or mma or nvrtc or params or fallback" > $R/tests.log 2>&1; save
timeout 60 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=sketch --no-plots --out $R/e2e > $R/e2e.log 2>&1; save
timeout 60 python3 bench_longctx/results/h200-session11/e2e_pairs.py bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=sketch --no-plots --out $R/e2e_pairs > $R/e2e_pairs.log 2>&1; save
timeout 200 python3 -m bench_longctx.sketch_bench --channels 64 --pairs 0,1 --out $R/sketch > $R/sketch.log 2>&1; save
echo done > $R/DONE; save
