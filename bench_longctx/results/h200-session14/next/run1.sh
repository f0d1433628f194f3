#!/usr/bin/env bash
# Planned in session 14 (its device time spent) for the next session's first call: mixed_parts.py (where a nearly
# all-fp16 mixed table's 1.5% goes), whether Nsight Compute is there for a stall breakdown of int8_mma.cu, and the
# GPU step tests after session 14's last edit to them (the twin_stores helper).
# Pattern as ../run8.sh: .snap/head.tar + .snap/rev, .whl/ carried.
set -uo pipefail
mkdir -p /tmp/w && rm -rf /tmp/w/* && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=/tmp/res1; mkdir -p $R; cp /tmp/w/REV $R/
save() { tar -czf $OUT/res1.tgz -C /tmp res1; }
cd /tmp/w
(which ncu nsys; ls /usr/local/cuda*/bin 2>&1 | head -20; nvidia-smi) > $R/tools.log 2>&1; save
timeout 120 python3 -m pytest -q -p no:cacheprovider -m cuda tests/kvstore/test_step.py tests/kvstore/test_step_dense.py > $R/tests_step.log 2>&1; save
timeout 150 python3 bench_longctx/results/h200-session14/next/mixed_parts.py $R/mixed > $R/mixed.log 2>&1; save
echo done > $R/DONE; save
