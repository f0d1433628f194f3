#!/usr/bin/env bash
# Session 8, call 1: the sketch first level's new knobs (persistent loop, word decode) swept at 1M; compiled sketch
# tests; where a captured sketch token's GPU time goes (step_profile); the steady put of fetch_bench.
set -uo pipefail
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:/tmp/w PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd /tmp/w
R=$OUT/res1; mkdir -p $R; cp REV $R/
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $R/gpu.txt 2>&1
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/eviction/test_sketch_channels.py tests/eviction/test_sketch_kernel.py tests/eviction/test_sketch_topk.py > $R/tests.log 2>&1
SWEEP='[{"blocks_per_program":16,"num_warps":4},{"blocks_per_program":16,"num_warps":4,"decode":2},
{"blocks_per_program":8,"num_warps":4},{"blocks_per_program":8,"num_warps":4,"decode":2},
{"blocks_per_program":16,"num_warps":4,"programs_per_sm":2},{"blocks_per_program":8,"num_warps":4,"programs_per_sm":2,"num_stages":2},
{"blocks_per_program":8,"num_warps":4,"programs_per_sm":3,"num_stages":2},{"blocks_per_program":4,"num_warps":4,"programs_per_sm":3,"num_stages":2},
{"blocks_per_program":4,"num_warps":4,"programs_per_sm":4},{"blocks_per_program":4,"num_warps":2,"programs_per_sm":6,"num_stages":2},
{"blocks_per_program":8,"num_warps":8,"programs_per_sm":1,"num_stages":2},{"blocks_per_program":4,"num_warps":4,"programs_per_sm":3,"num_stages":2,"decode":2},
{"blocks_per_program":8,"num_warps":4,"programs_per_sm":2,"num_stages":2,"decode":2},{"blocks_per_program":4,"num_warps":2,"programs_per_sm":4,"num_stages":3}]'
timeout 280 python3 -m bench_longctx.sketch_bench --out $R/sketch --channels 64 --scan-sweep "$SWEEP" > $R/sketch.log 2>&1
timeout 150 python3 -m bench_longctx.step_profile --out $R/profile --mode sketch --steps 8 > $R/profile.log 2>&1
timeout 60 python3 -m bench_longctx.fetch_bench --out $R/fetch.json > $R/fetch.log 2>&1
cd $OUT && tar -czf res1.tgz res1 && rm -rf res1
