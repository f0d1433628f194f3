#!/usr/bin/env bash
# Session 10, call 5: two accumulator chains in Q.K^T with 2 and 3 stages (this tree, KVTIER_INT8_MMA_STAGES) vs
# call 3's tree (base: one chain, 2 stages), same call: int8 CUDA tests, int8_bench --quick, e2e dense at 1M.
set -uo pipefail
mkdir -p /tmp/w /tmp/b && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV && tar -xf .snap/base.tar -C /tmp/b && cp .snap/baserev /tmp/b/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVTIER_INT8_MMA=1
R=/tmp/res5; mkdir -p $R; cp /tmp/w/REV $R/; cp /tmp/b/REV $R/BASEREV
save() { tar -czf $OUT/res5.tgz -C /tmp res5; }
KV='from kvstore.cli import main; raise SystemExit(main())'
cd /tmp/w && PYTHONPATH=/tmp/site:/tmp/w timeout 100 python3 -m pytest -q -p no:cacheprovider -m cuda tests/kvstore/attention/test_int8_mma.py -x > $R/t_int8.log 2>&1; save
for v in w2 w3 b2; do t=${v:0:1}; export KVTIER_INT8_MMA_STAGES=${v:1:1}; cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 100 python3 -m bench_longctx.int8_bench --quick --out $R/int8_$v > $R/int8_$v.log 2>&1; save; done
for v in w2 w3 b2; do t=${v:0:1}; export KVTIER_INT8_MMA_STAGES=${v:1:1}; cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 60 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=dense --no-plots --out $R/e2e_$v > $R/e2e_$v.log 2>&1; save; done
echo done > $R/DONE; save
