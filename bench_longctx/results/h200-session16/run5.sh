#!/usr/bin/env bash
# Session 16, call 5 (same machine as call 4): the CUDA-marked tests without the service suite (call 4's collection
# stopped at schemathesis, which the device lacks); e2e again on this tree, then session 15's, now that every
# kernel of both is in the machine's compile caches (call 4 ran this tree first: its eager rows paid the compiles).
set -uo pipefail
for t in base head; do mkdir -p /tmp/$t && rm -rf /tmp/$t/* && tar -xf .snap/$t.tar -C /tmp/$t; done
cp .snap/rev /tmp/head/REV; cp .snap/baserev /tmp/base/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/res5; mkdir -p $R; cp /tmp/head/REV $R/REV; cp /tmp/base/REV $R/BASEREV
save() { tar -czf $OUT/res5.tgz -C /tmp res5; }
cd /tmp/head
PYTHONPATH=/tmp/site:/tmp/head timeout 220 python3 -m pytest -q -p no:cacheprovider -m cuda tests \
  --ignore=tests/kvstore/service > $R/tests.log 2>&1; save
KV='from kvstore.cli import main; raise SystemExit(main())'
E="bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=topk,dense --no-plots"
for t in head base; do
  cd /tmp/$t
  PYTHONPATH=/tmp/site:/tmp/$t timeout 140 python3 -c "$KV" $E --out $R/e2e_$t > $R/e2e_$t.log 2>&1; save
done
echo done > $R/DONE; save
