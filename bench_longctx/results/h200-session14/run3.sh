#!/usr/bin/env bash
# Session 14 call 3: the sketch kernel tests that call 1 (run1.sh) cut off at its 220 s limit, verbose with durations.
set -uo pipefail
mkdir -p /tmp/w && rm -rf /tmp/w/* && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=/tmp/res3; mkdir -p $R; cp /tmp/w/REV $R/
save() { tar -czf $OUT/res3.tgz -C /tmp res3; }
cd /tmp/w
timeout 250 python3 -m pytest -v -p no:cacheprovider --durations=15 tests/eviction/test_sketch_mma.py tests/eviction/test_sketch_channels.py tests/kvcuda > $R/tests_mma.log 2>&1; save
timeout 280 python3 -m pytest -v -p no:cacheprovider --durations=15 tests/eviction/test_sketch_kernel.py tests/eviction/test_sketch_topk.py > $R/tests_topk.log 2>&1; save
echo done > $R/DONE; save
