#!/usr/bin/env bash
# Planned in session 13 (no device lent then), the next session's second call: the first level and selection at 48
# and 64 channels with the real kernels (sketch_bench: needles, bound violations, times; 48 is an option, not the
# default: unread_study.py lost needles with it at 1M), then the dense layer step at 8K-32K against the
# session-start tree (.snap/base.tar, .snap/baserev), whose captured dense step partitions all-hot tables.
set -uo pipefail
for t in w:head b:base; do d=/tmp/${t%%:*}; mkdir -p $d && rm -rf $d/* && tar -xf .snap/${t##*:}.tar -C $d; done
cp .snap/rev /tmp/w/REV; cp .snap/baserev /tmp/b/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/res2; mkdir -p $R; cp /tmp/w/REV $R/; cp /tmp/b/REV $R/BASEREV
save() { tar -czf $OUT/res2.tgz -C /tmp res2; }
KV='from kvstore.cli import main; raise SystemExit(main())'
D="bench decode --preset h200 --set decode.contexts=8K,16K,32K --set decode.budgets=4096 --no-plots"
cd /tmp/w; export PYTHONPATH=/tmp/site:/tmp/w
timeout 280 python3 -m bench_longctx.sketch_bench --channels 48,64 --out $R/sketch > $R/sketch.log 2>&1; save
timeout 100 python3 -c "$KV" $D --out $R/decode_head > $R/decode_head.log 2>&1; save
cd /tmp/b; export PYTHONPATH=/tmp/site:/tmp/b
timeout 100 python3 -c "$KV" $D --out $R/decode_base > $R/decode_base.log 2>&1; save
cd /tmp/w; export PYTHONPATH=/tmp/site:/tmp/w
timeout 100 python3 -c "$KV" $D --out $R/decode_head2 > $R/decode_head2.log 2>&1; save
echo done > $R/DONE; save
