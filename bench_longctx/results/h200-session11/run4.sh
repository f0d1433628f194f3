#!/usr/bin/env bash
# Session 11, call 4: the restructured CUDA sketch first level (persistent programs, summaries through the tile
# buffer): variants at 1M (variants.py), its GPU tests, e2e sketch.
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=/tmp/res4; mkdir -p $R; cp /tmp/w/REV $R/
save() { tar -czf $OUT/res4.tgz -C /tmp res4; }
KV='from kvstore.cli import main; raise SystemExit(main())'
cd /tmp/w
timeout 150 python3 bench_longctx/results/h200-session11/variants.py $R/variants.json > $R/variants.log 2>&1; save
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/eviction/test_sketch_mma.py > $R/tests.log 2>&1; save
timeout 60 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=sketch --no-plots --out $R/e2e > $R/e2e.log 2>&1; save
echo done > $R/DONE; save
