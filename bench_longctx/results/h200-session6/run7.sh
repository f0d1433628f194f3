#!/usr/bin/env bash
# Session 6, call 7: the dense step per layer at 8K-32K under bucket / tile / merge-chunk variants (diag_dense8k.py).
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV && cp .snap/diag_dense8k.py /tmp/w/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:/tmp/w PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd /tmp/w
R=$OUT/res7; mkdir -p $R; cp REV diag_dense8k.py $R/
timeout 400 python3 diag_dense8k.py $R/dense8k_variants.json > $R/dense8k_variants.log 2>&1
cd $OUT && tar -czf res7.tgz res7 && rm -rf res7
