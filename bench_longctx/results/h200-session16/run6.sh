#!/usr/bin/env bash
# Session 16, call 6: int8_bench --quick on this tree (the merge's 128-wide steps): its own table of every mix, at
# 128K and 1M, block 32 and 64, against SDPA and the copy ceiling in the same process.
set -uo pipefail
mkdir -p /tmp/head && rm -rf /tmp/head/* && tar -xf .snap/head.tar -C /tmp/head
cp .snap/rev /tmp/head/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/head
R=/tmp/res6; mkdir -p $R; cp /tmp/head/REV $R/REV
save() { tar -czf $OUT/res6.tgz -C /tmp res6; }
cd /tmp/head
timeout 400 python3 -m bench_longctx.int8_bench --quick --out $R/int8 > $R/int8.log 2>&1; save
echo done > $R/DONE; save
