#!/usr/bin/env bash
# Session 14 call 5: e2e llama3-8b geometry at 1M, dense int8, every token appended and read back: this tree (the
# dense step's partition kept between tokens) against the session-start tree a6ceee9 (partitioned in every layer of
# every token), alternated twice in one call.
set -uo pipefail
for t in w:head b:base; do d=/tmp/${t%%:*}; mkdir -p $d && rm -rf $d/* && tar -xf .snap/${t##*:}.tar -C $d; done
cp .snap/rev /tmp/w/REV; cp .snap/baserev /tmp/b/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/res5; mkdir -p $R; cp /tmp/w/REV $R/; cp /tmp/b/REV $R/BASEREV
save() { tar -czf $OUT/res5.tgz -C /tmp res5; }
KV='from kvstore.cli import main; raise SystemExit(main())'
E="bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=dense --no-plots"
for i in 1 2; do
  for t in w b; do
    cd /tmp/$t; export PYTHONPATH=/tmp/site:/tmp/$t
    timeout 100 python3 -c "$KV" $E --out $R/e2e_${t}$i > $R/e2e_${t}$i.log 2>&1; save
  done
done
echo done > $R/DONE; save
