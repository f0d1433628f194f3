#!/usr/bin/env bash
# Session 16, call 8: the int8 kernel's GPU tests (every head_dim / block_tokens it serves, against the reference)
# with the V decode of call 7 shipped.
set -uo pipefail
mkdir -p /tmp/head && rm -rf /tmp/head/* && tar -xf .snap/head.tar -C /tmp/head
cp .snap/rev /tmp/head/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/head
R=/tmp/res8; mkdir -p $R; cp /tmp/head/REV $R/REV
save() { tar -czf $OUT/res8.tgz -C /tmp res8; }
cd /tmp/head
timeout 140 python3 -m pytest -q -p no:cacheprovider tests/kvstore/attention/test_int8_mma.py \
  tests/kvstore/attention/test_partition.py -k "int8 or all_int8 or mixed or cooled or few_hot" > $R/tests.log 2>&1; save
echo done > $R/DONE; save
