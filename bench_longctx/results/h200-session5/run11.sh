#!/usr/bin/env bash
# Session 5, call 5: store.load of an opened 256K context, this tree (moves into the GPU fetched onto the device,
# in batches) against bc47ef2 (the call-4 tree) in the same run; then this tree loading into the cpu tier.
set -uo pipefail
for t in new old; do mkdir -p /tmp/$t && tar -xf .snap/$([ $t = new ] && echo head || echo old).tar -C /tmp/$t; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=$OUT/res11; mkdir -p $R /dev/shm/c; cp .snap/rev $R/REV
run() {  # tree, name, extra args
  (cd /tmp/$1 && PYTHONPATH=/tmp/site:/tmp/$1 timeout 100 python3 -m bench_longctx.contexts_bench --preset h200 --open-tokens 256K --fork-tokens 0 "${@:3}" --out /dev/shm/c/$2.json > $R/$2.log 2>&1; cp /dev/shm/c/$2.json $R/ 2>/dev/null)
}
run new load_warm_new --warm-tokens 262144 --gpu-bytes 21474836480
run old load_warm_old --warm-tokens 262144 --gpu-bytes 21474836480
run new load_cpu_new
cd $OUT && tar -czf res11.tgz res11 && rm -rf res11
