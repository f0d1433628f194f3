#!/usr/bin/env bash
# Session 10, call 2: the cp.async form of the CUDA int8 walk: compiled tests, int8_bench --quick and e2e dense at 1M with it on (call 1 has the Triton loop in the same benches).
# e2e dense int8 decode at 1M with it on (KVTIER_INT8_MMA=1) and off (=0: the Triton loop, i.e. the baseline), same
# call; then session 9's unverified mends (attention, step, sketch-store, graph tests).
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=/tmp/res2; mkdir -p $R; cp /tmp/w/REV $R/
save() { tar -czf $OUT/res2.tgz -C /tmp res2; }
KV='from kvstore.cli import main; raise SystemExit(main())'
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $R/gpu.txt 2>&1
cd /tmp/w
timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests/kvstore/attention/test_int8_mma.py -x > $R/t_int8.log 2>&1; save
for on in 1; do KVTIER_INT8_MMA=$on timeout 120 python3 -m bench_longctx.int8_bench --quick --out $R/int8_$on > $R/int8_$on.log 2>&1; save; done
for on in 1; do KVTIER_INT8_MMA=$on timeout 75 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=dense --no-plots --out $R/e2e_$on > $R/e2e_$on.log 2>&1; save; done
echo done > $R/DONE; save
