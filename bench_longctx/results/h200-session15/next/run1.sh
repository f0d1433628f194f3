#!/usr/bin/env bash
# Planned as session 15 call 4 (no machine was lent; e2e ran in call 5): e2e llama3-8b geometry at 1M, dense int8, every token appended and read back: this tree (the leaner int8
# walk, the programmatic int8 launch) against session 14's final tree 9a3bfd2, alternated twice in one call;
# then walk_variants2.py (3 stages, an L2 prefetch of the next block) on this tree.
set -uo pipefail
for t in w:head b:base; do d=/tmp/${t%%:*}; mkdir -p $d && rm -rf $d/* && tar -xf .snap/${t##*:}.tar -C $d; done
cp .snap/rev /tmp/w/REV; cp .snap/baserev /tmp/b/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=/tmp/res4; mkdir -p $R; cp /tmp/w/REV $R/; cp /tmp/b/REV $R/BASEREV
save() { tar -czf $OUT/res4.tgz -C /tmp res4; }
KV='from kvstore.cli import main; raise SystemExit(main())'
E="bench e2e --preset h200 --set e2e.steps=256 --set e2e.modes=dense --no-plots"
for i in 1 2; do
  for t in w b; do
    cd /tmp/$t; export PYTHONPATH=/tmp/site:/tmp/$t
    timeout 100 python3 -c "$KV" $E --out $R/e2e_${t}$i > $R/e2e_${t}$i.log 2>&1; save
  done
done
cd /tmp/w; export PYTHONPATH=/tmp/site:/tmp/w
timeout 150 python3 bench_longctx/results/h200-session15/walk_variants2.py $R/variants2 > $R/variants2.log 2>&1; save
echo done > $R/DONE; save
