#!/usr/bin/env bash
# Session 5, call 1: compiled tests of the in-step cpu staging, then e2e at 1M with 3/4 of the context in cpu.
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:/tmp/w PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd /tmp/w
R=$OUT/res8; mkdir -p $R; cp REV $R/
KV='from kvstore.cli import main; raise SystemExit(main())'
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; df -h /tmp /dev/shm; free -g; id) > $R/machine.txt 2>&1
timeout 90 python3 -m pytest -v -p no:cacheprovider tests/tiers/test_slice_gather.py tests/tiers/test_cpu.py tests/tiers/test_block_checksum.py tests/kvstore/test_step.py > $R/unit_tests.log 2>&1
timeout 170 python3 -m pytest -v -p no:cacheprovider -m cuda tests/engine_adapter/test_graph_decode.py > $R/graph_tests.log 2>&1
timeout 330 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=64 --set e2e.warm_tokens=256K --set e2e.modes=topk,sketch --no-plots --out $R/e2e1m_cold > $R/e2e1m_cold.log 2>&1
cd $OUT && tar -czf res8.tgz res8 && rm -rf res8
