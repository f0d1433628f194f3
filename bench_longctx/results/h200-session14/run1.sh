#!/usr/bin/env bash
# Planned in session 13 (no device lent then), for the next session's first call: the GPU tests of what session 13
# changed (the first level at 48 channels, CUDA and Triton; the captured step's hot-only dense walk).
# Pattern as results/h200-session12/run9.sh: .snap/head.tar + .snap/rev, .whl/ carried.
set -uo pipefail
mkdir -p /tmp/w && rm -rf /tmp/w/* && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=/tmp/res1; mkdir -p $R; cp /tmp/w/REV $R/
save() { tar -czf $OUT/res1.tgz -C /tmp res1; }
cd /tmp/w
timeout 220 python3 -m pytest -q -p no:cacheprovider tests/eviction/test_sketch_mma.py tests/eviction/test_sketch_channels.py tests/eviction/test_sketch_kernel.py tests/eviction/test_sketch_topk.py tests/kvcuda > $R/tests_sketch.log 2>&1; save
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kvstore/test_step.py tests/kvstore/test_sketch_store.py > $R/tests_step.log 2>&1; save
timeout 80 python3 -m pytest -q -p no:cacheprovider -m cuda tests/engine_adapter/test_graph_decode.py > $R/tests_graph.log 2>&1; save
echo done > $R/DONE; save
