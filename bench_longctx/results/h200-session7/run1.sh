#!/usr/bin/env bash
# Session 7, call 1: the last session's unverified changes on the H200: compiled tests of the captured step's
# promotion and the direct put from the GPU; fetch_bench (put_from_gpu); e2e at 1M with 3/4 of the context in cpu,
# this tree and the tree before promotion (d01d50c^) in the same call.
set -uo pipefail
mkdir -p /tmp/w /tmp/b && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV && tar -xf .snap/base.tar -C /tmp/b && cp .snap/baserev /tmp/b/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:/tmp/w PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd /tmp/w
R=$OUT/res1; mkdir -p $R; cp REV $R/; cp /tmp/b/REV $R/BASEREV
KV='from kvstore.cli import main; raise SystemExit(main())'
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; df -h /tmp /dev/shm; free -g) > $R/machine.txt 2>&1
timeout 80 python3 -m pytest -v -p no:cacheprovider tests/tiers/test_slice_gather.py tests/tiers/test_cpu.py tests/tiers/test_block_checksum.py tests/kvstore/test_step.py > $R/unit_tests.log 2>&1
timeout 80 python3 -m pytest -v -p no:cacheprovider -m cuda tests/engine_adapter/test_graph_decode.py > $R/graph_tests.log 2>&1
timeout 90 python3 -m bench_longctx.fetch_bench --out $R/fetch_h200.json > $R/fetch.log 2>&1
timeout 170 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=64 --set e2e.warm_tokens=256K --set e2e.modes=topk,sketch --no-plots --out $R/e2e1m_cold > $R/e2e1m_cold.log 2>&1
cd /tmp/b && export PYTHONPATH=/tmp/site:/tmp/b
timeout 160 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=64 --set e2e.warm_tokens=256K --set e2e.modes=topk --no-plots --out $R/e2e1m_cold_base > $R/e2e1m_cold_base.log 2>&1
cd $OUT && tar -czf res1.tgz res1 && rm -rf res1
