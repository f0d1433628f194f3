#!/usr/bin/env bash
# Session 12, call 2: the first level over block-major vs channel-major codes (same bytes, same kernel), and the
# CUDA kernel tests after the channel-stride parameter. (layout_study.py stopped at an argsort call here: call 3.)
set -uo pipefail
mkdir -p /tmp/w && rm -rf /tmp/w/* && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=/tmp/res2; mkdir -p $R; cp /tmp/w/REV $R/
save() { tar -czf $OUT/res2.tgz -C /tmp res2; }
cd /tmp/w
timeout 120 python3 bench_longctx/results/h200-session12/layout_study.py $R/layout.json > $R/layout.log 2>&1; save
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/eviction/test_sketch_mma.py tests/kvcuda > $R/tests_kernels.log 2>&1; save
echo done > $R/DONE; save
