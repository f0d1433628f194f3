#!/usr/bin/env bash
# Session 17, call 2: the CUDA-marked tests on the final tree; then e2e llama3-8b geometry at 1M (top-K 4096 and dense
# int8, every token appended and read back), final tree, 05d6567, final tree again.
set -uo pipefail
for t in base head; do mkdir -p /tmp/$t && rm -rf /tmp/$t/* && tar -xf .snap/$t.tar -C /tmp/$t; done
cp .snap/rev /tmp/head/REV; cp .snap/baserev /tmp/base/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/res2; rm -rf $R; mkdir -p $R; cp /tmp/head/REV $R/REV; cp /tmp/base/REV $R/BASEREV
save() { tar -czf $OUT/res2.tgz -C /tmp res2; }
cd /tmp/head
PYTHONPATH=/tmp/site:/tmp/head timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests --ignore=tests/kvstore/service > $R/tests.log 2>&1; save
KV='from kvstore.cli import main; raise SystemExit(main())'
E="bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=topk,dense --no-plots"
for t in head base head2; do
  d=${t%2}; cd /tmp/$d
  PYTHONPATH=/tmp/site:/tmp/$d timeout 130 python3 -c "$KV" $E --out $R/e2e_$t > $R/e2e_$t.log 2>&1; save
done
echo done > $R/DONE; save
