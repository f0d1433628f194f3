#!/usr/bin/env bash
# Session 17 call 1: session 16's next/run1.sh (int8_bench --quick on the final tree; walk_mix head vs 05d6567
# alternated), then next/walk_variants4.py (V operands by ldmatrix.trans against the shipped decode).
set -uo pipefail
for t in base head; do mkdir -p /tmp/$t && rm -rf /tmp/$t/* && tar -xf .snap/$t.tar -C /tmp/$t; done
cp .snap/rev /tmp/head/REV; cp .snap/baserev /tmp/base/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/res1; rm -rf $R; mkdir -p $R; cp /tmp/head/REV $R/REV; cp /tmp/base/REV $R/BASEREV
save() { tar -czf $OUT/res1.tgz -C /tmp res1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $R/smi.txt 2>&1
cp /tmp/head/bench_longctx/results/h200-session16/walk_mix.py /tmp/walk_mix.py
cd /tmp/head
PYTHONPATH=/tmp/site:/tmp/head timeout 200 python3 bench_longctx/results/h200-session16/next/walk_variants4.py $R/wv4 > $R/wv4.log 2>&1; save
PYTHONPATH=/tmp/site:/tmp/head timeout 200 python3 -m bench_longctx.int8_bench --quick --out $R/int8 > $R/int8.log 2>&1; save
for rep in 1 2; do
  for t in head base; do
    (cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 60 python3 /tmp/walk_mix.py $R/time ${t}$rep) >> $R/time.log 2>&1
    save
  done
done
echo done > $R/DONE; save
