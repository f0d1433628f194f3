#!/usr/bin/env bash
# Session 6, call 10: the final tree's compiled merge (H2O add) and DecodeStep tests.
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:/tmp/w PYTHONUNBUFFERED=1
cd /tmp/w
R=$OUT/res10; mkdir -p $R; cp REV $R/
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kvstore/attention/test_paged_decode.py tests/kvstore/attention/test_one_tile.py tests/kvstore/test_step.py > $R/tests.log 2>&1
cd $OUT && tar -czf res10.tgz res10 && rm -rf res10
