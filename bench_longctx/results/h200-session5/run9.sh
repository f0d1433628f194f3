#!/usr/bin/env bash
# Session 5, call 3: the graph tests after the fp16 change, then a 1M context saved into /dev/shm (the disk
# holds 64 GiB, the save 74 GB) and opened in new processes.
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:/tmp/w PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd /tmp/w
R=$OUT/res9; mkdir -p $R; cp REV $R/
timeout 60 python3 -m pytest -v -p no:cacheprovider -m cuda tests/engine_adapter/test_graph_decode.py -k "over_cpu_blocks or reads_cpu" > $R/graph_tests.log 2>&1
mkdir -p /dev/shm/c
(while true; do date +%T; free -g | sed -n 2p; df -h /dev/shm | tail -1; sleep 20; done) > $R/memory.log 2>&1 &
timeout 500 python3 -m bench_longctx.contexts_bench --preset h200 --open-tokens 1M --fork-tokens 0 --warm-tokens 1048576 --gpu-bytes 75161927680 --out /dev/shm/c/contexts_h200_1m.json > $R/contexts_1m.log 2>&1
cp /dev/shm/c/*.json $R/ 2>/dev/null
cd $OUT && tar -czf res9.tgz res9 && rm -rf res9
