#!/usr/bin/env bash
# Planned for the next session (session 16's device time ran out): int8_bench --quick on the final tree (the shipped
# V decode: its own verdict on 1.7x and on first_cooled), then walk_mix.py in that tree and in 05d6567, alternated.
# Needs .snap/head.tar (HEAD), .snap/base.tar (05d6567), .snap/rev, .snap/baserev and .whl/ (see README's pattern).
set -uo pipefail
for t in base head; do mkdir -p /tmp/$t && rm -rf /tmp/$t/* && tar -xf .snap/$t.tar -C /tmp/$t; done
cp .snap/rev /tmp/head/REV; cp .snap/baserev /tmp/base/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/res1; mkdir -p $R; cp /tmp/head/REV $R/REV; cp /tmp/base/REV $R/BASEREV
save() { tar -czf $OUT/res1.tgz -C /tmp res1; }
cp /tmp/head/bench_longctx/results/h200-session16/walk_mix.py /tmp/walk_mix.py
cd /tmp/head
PYTHONPATH=/tmp/site:/tmp/head timeout 300 python3 -m bench_longctx.int8_bench --quick --out $R/int8 > $R/int8.log 2>&1; save
for rep in 1 2; do
  for t in head base; do
    (cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 90 python3 /tmp/walk_mix.py $R/time ${t}$rep) >> $R/time.log 2>&1
    save
  done
done
echo done > $R/DONE; save
