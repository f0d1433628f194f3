#!/usr/bin/env bash
# Session 15, call 5: the int8 walk's residency capped at 2 programs an SM (call 3: the programmatic launch packed 3
# on some SMs, sinks + recent 0.73 ms against 0.58). GPU tests of the int8 kernel; walk_time.py in this tree with
# the programmatic launch on and off, and in the session-14 tree, alternated twice; then e2e dense at 1M, this tree
# against session 14's, alternated (run4.sh's loop, as far as the time goes).
set -uo pipefail
for t in base head; do mkdir -p /tmp/$t && rm -rf /tmp/$t/* && tar -xf .snap/$t.tar -C /tmp/$t; done
cp .snap/rev /tmp/head/REV; cp .snap/baserev /tmp/base/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/res5; mkdir -p $R; cp /tmp/head/REV $R/REV; cp /tmp/base/REV $R/BASEREV
save() { tar -czf $OUT/res5.tgz -C /tmp res5; }
S=bench_longctx/results/h200-session15
cp /tmp/head/$S/walk_time.py /tmp/walk_time.py
cd /tmp/head
PYTHONPATH=/tmp/site:/tmp/head timeout 120 python3 -m pytest -q -p no:cacheprovider -m cuda \
  tests/kvstore/attention/test_int8_mma.py > $R/tests.log 2>&1; save
for rep in 1 2; do
  for t in head_pdl head_nopdl base; do
    dir=/tmp/${t%%_*}; pdl=1; [ $t = head_nopdl ] && pdl=0
    (cd $dir && KVTIER_PDL=$pdl PYTHONPATH=/tmp/site:$dir timeout 100 python3 /tmp/walk_time.py $R/time ${t}$rep) >> $R/time.log 2>&1
    save
  done
done
KV='from kvstore.cli import main; raise SystemExit(main())'
E="bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=dense --no-plots"
for i in 1 2; do
  for t in head base; do
    cd /tmp/$t; export PYTHONPATH=/tmp/site:/tmp/$t
    timeout 90 python3 -c "$KV" $E --out $R/e2e_${t}$i > $R/e2e_${t}$i.log 2>&1; save
  done
done
echo done > $R/DONE; save
