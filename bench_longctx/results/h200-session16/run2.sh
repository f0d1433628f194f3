#!/usr/bin/env bash
# Session 16, call 2 (tree: 95152fe reverted): merge_variants.py (the merge's loop over 66 splits), session 15's
# walk_variants2.py (3 stages, an L2 prefetch of the next block on the int8 walk), the attention GPU tests.
set -uo pipefail
mkdir -p /tmp/head && rm -rf /tmp/head/* && tar -xf .snap/head.tar -C /tmp/head
cp .snap/rev /tmp/head/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/head
R=/tmp/res2; mkdir -p $R; cp /tmp/head/REV $R/REV
save() { tar -czf $OUT/res2.tgz -C /tmp res2; }
cd /tmp/head
timeout 90 python3 bench_longctx/results/h200-session16/merge_variants.py $R/merge > $R/merge.log 2>&1; save
timeout 170 python3 bench_longctx/results/h200-session15/walk_variants2.py $R/variants2 > $R/variants2.log 2>&1; save
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kvstore/attention/test_partition.py \
  tests/kvstore/attention/test_int8_mma.py tests/kvstore/attention/test_merge_outputs.py > $R/tests.log 2>&1; save
echo done > $R/DONE; save
