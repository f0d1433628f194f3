#!/usr/bin/env bash
# Session 9, call 5: the final tree: where a captured dense 8K token goes (step_profile) this tree vs 252818a; e2e
# at 1M, every mode (topk, sketch, dense int8), this tree.
set -uo pipefail
mkdir -p /tmp/w5 /tmp/b5 && tar -xf .snap/head.tar -C /tmp/w5 && cp .snap/rev /tmp/w5/REV && tar -xf .snap/base.tar -C /tmp/b5 && cp .snap/baserev /tmp/b5/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/res5; mkdir -p $R; cp /tmp/w5/REV $R/; cp /tmp/b5/REV $R/BASEREV
KV='from kvstore.cli import main; raise SystemExit(main())'
save() { cd $OUT && tar -czf res5.tgz -C /tmp res5; }
for t in w5 b5; do cd /tmp/$t && PYTHONPATH=/tmp/site:/tmp/$t timeout 90 python3 -m bench_longctx.step_profile --out $R/profile_$t --mode dense --context 8192 --steps 8 > $R/profile_$t.log 2>&1; done
save
cd /tmp/w5 && PYTHONPATH=/tmp/site:/tmp/w5 timeout 100 python3 -c "$KV" bench e2e --preset h200 --set e2e.steps=256 --no-plots --out $R/e2e1m > $R/e2e1m.log 2>&1
save
