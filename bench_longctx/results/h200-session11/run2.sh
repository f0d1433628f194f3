#!/usr/bin/env bash
# Session 11, call 2: the CUDA sketch first level (eviction/sketch_mma.cu) first run: its GPU tests (and the int8
# kernel's after the kvcuda refactor), sketch_bench at 1M (CUDA row vs the Triton sweep, same process), e2e sketch
# with the CUDA first level on and off (KVTIER_SKETCH_MMA), same call.
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=/tmp/res2; mkdir -p $R; cp /tmp/w/REV $R/
save() { tar -czf $OUT/res2.tgz -C /tmp res2; }
KV='from kvstore.cli import main; raise SystemExit(main())'
cd /tmp/w
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/eviction/test_sketch_mma.py tests/eviction/test_sketch_channels.py tests/kvcuda tests/kvstore/attention/test_int8_mma.py > $R/tests.log 2>&1; save
for on in 1 0; do KVTIER_SKETCH_MMA=$on timeout 60 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=sketch --no-plots --out $R/e2e_$on > $R/e2e_$on.log 2>&1; save; done
timeout 200 python3 -m bench_longctx.sketch_bench --channels 32,64 --out $R/sketch > $R/sketch.log 2>&1; save
echo done > $R/DONE; save
