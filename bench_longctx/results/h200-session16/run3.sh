#!/usr/bin/env bash
# Session 16, call 3: the merge's steps 128 wide (66 splits in one step). merge_variants.py (also 256-2112 splits:
# one-tile tables); walk_mix.py in this tree and session 15's (05d6567), alternated twice; walk_variants2.py with
# its launch fixed; the attention GPU tests.
set -uo pipefail
for t in base head; do mkdir -p /tmp/$t && rm -rf /tmp/$t/* && tar -xf .snap/$t.tar -C /tmp/$t; done
cp .snap/rev /tmp/head/REV; cp .snap/baserev /tmp/base/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/res3; mkdir -p $R; cp /tmp/head/REV $R/REV; cp /tmp/base/REV $R/BASEREV
save() { tar -czf $OUT/res3.tgz -C /tmp res3; }
S=bench_longctx/results/h200-session16
cp /tmp/head/$S/walk_mix.py /tmp/walk_mix.py
cd /tmp/head
PYTHONPATH=/tmp/site:/tmp/head timeout 90 python3 $S/merge_variants.py $R/merge > $R/merge.log 2>&1; save
for rep in 1 2; do
  for t in head base; do
    (cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 90 python3 /tmp/walk_mix.py $R/time ${t}$rep) >> $R/time.log 2>&1
    save
  done
done
cd /tmp/head
PYTHONPATH=/tmp/site:/tmp/head timeout 150 python3 bench_longctx/results/h200-session15/walk_variants2.py $R/variants2 > $R/variants2.log 2>&1; save
PYTHONPATH=/tmp/site:/tmp/head timeout 100 python3 -m pytest -q -p no:cacheprovider \
  tests/kvstore/attention/test_merge_outputs.py tests/kvstore/attention/test_one_tile.py > $R/tests.log 2>&1; save
echo done > $R/DONE; save
