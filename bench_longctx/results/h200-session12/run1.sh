#!/usr/bin/env bash
# Session 12, call 1: where a 1M sketch token's GPU time goes (step_profile, sketch / topk), and the bits study:
# needle ranks at 1M under b-bit estimates of the r channels of largest |q|.
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=/tmp/res1; mkdir -p $R; cp /tmp/w/REV $R/
S=$PWD/.snap/study
save() { tar -czf $OUT/res1.tgz -C /tmp res1; }
cd /tmp/w
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > $R/gpu.txt 2>&1
timeout 150 python3 -m bench_longctx.step_profile --out $R/prof --mode sketch --steps 16 > $R/prof_sketch.log 2>&1; save
timeout 120 python3 -m bench_longctx.step_profile --out $R/prof --mode topk --steps 16 > $R/prof_topk.log 2>&1; save
timeout 200 python3 $S/bits.py 1048576 $R/bits_1m.json > $R/bits.log 2>&1; save
echo done > $R/DONE; save
