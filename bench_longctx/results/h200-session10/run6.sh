#!/usr/bin/env bash
# Session 10, call 6: the final tree with the CUDA int8 walk on (KVTIER_INT8_MMA=1) and off (=0, the Triton loop:
# the baseline), same call: e2e dense int8 at 1M, then int8_bench --quick.
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=/tmp/res6; mkdir -p $R; cp /tmp/w/REV $R/
save() { tar -czf $OUT/res6.tgz -C /tmp res6; }
KV='from kvstore.cli import main; raise SystemExit(main())'
cd /tmp/w
for on in 1 0; do KVTIER_INT8_MMA=$on timeout 60 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=dense --no-plots --out $R/e2e_$on > $R/e2e_$on.log 2>&1; save; done
for on in 1 0; do KVTIER_INT8_MMA=$on timeout 90 python3 -m bench_longctx.int8_bench --quick --out $R/int8_$on > $R/int8_$on.log 2>&1; save; done
echo done > $R/DONE; save
