#!/usr/bin/env bash
# The H200 benchmark suites, in order; STEP=<suite> runs one. Each result JSON lands in $1 (default
# /tmp/kvtier-h200, outside the tree). The device image has torch/triton/numpy/psutil; the rest
# (lmdb, zstandard, xxhash, fastapi, uvicorn, redis, ...) come as wheels in .whl/.
set -uo pipefail
out=${1:-/tmp/kvtier-h200}  # scratch: a headline result is copied into bench_longctx/baselines/
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
step=${STEP:-all}
if [ "$step" = all ] || [ "$step" = tests ]; then
  # the kernel tests (CPU-interpreted in CI, compiled here), then the tests marked `cuda`, which skip
  # without a GPU (tests/engine_adapter: their modules import with only the wheels above)
  # (~490 tests, most of the time Triton compiles: two runs of ~4 minutes)
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rf tests/kvstore/attention tests/kvstore/decode \
    tests/tiers/test_slice_gather.py tests/tiers/test_fetch_kernel.py 2>&1 | tail -15 | tee "$out/gpu_tests.log"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rf tests/eviction 2>&1 | tail -15 | tee -a "$out/gpu_tests.log"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rf -m cuda tests/engine_adapter 2>&1 | tail -15 \
    | tee -a "$out/gpu_tests.log"
fi
if [ "$step" = all ] || [ "$step" = select ]; then
  timeout 150 python3 -m bench_longctx.select_bench --out "$out" 2>&1 | tail -6
fi
if [ "$step" = all ] || [ "$step" = decode ]; then
  timeout 300 python3 -m bench_longctx.decode_bench --out "$out" 2>&1 | tail -8
fi
if [ "$step" = all ] || [ "$step" = tiers ]; then
  timeout 200 python3 -m bench_longctx.tiers_bench --out "$out" 2>&1 | tail -60
fi
if [ "$step" = all ] || [ "$step" = sketch ]; then
  # the sketch selector's stages at 1M; graded norm-matched needles at 32K/256K/1M (topk = sketch,
  # quest, window and h2o as controls); real SmolLM2 Q/K at 8K, mass vs oracle (quality suite, with perplexity)
  timeout 300 python3 -m bench_longctx.sketch_bench --out "$out" 2>&1 | tail -4
  timeout 500 python3 -c "from bench_longctx.cli import main; raise SystemExit(main())" bench needle --preset h200 \
    --no-plots --out "$out/needle-h200" 2>&1 | tail -40
  timeout 500 python3 -c "from bench_longctx.cli import main; raise SystemExit(main())" bench quality --preset h200 \
    --no-plots --out "$out/quality-h200" 2>&1 | tail -40
fi
if [ "$step" = all ] || [ "$step" = contexts ]; then
  # save, then open in a new process (cold, then warmed up + store.load) and decode; 512K fits a 64 GiB
  # disk (37 GB saved), 1M needs ~80 GB free (--open-tokens 1M)
  timeout 400 python3 -m bench_longctx.contexts_bench --preset h200 --open-tokens 512K --fork-tokens 0 \
    --out "$out/contexts_h200.json" 2>&1 | tail -4
fi
if [ "$step" = contexts-background ]; then
  # the same, plus a child that opens with a background load and decodes until it ends (each token's path)
  timeout 500 python3 -m bench_longctx.contexts_bench --preset h200 --open-tokens 128K --fork-tokens 0 \
    --background --out "$out/contexts_background_h200.json" 2>&1 | tail -6
fi
if [ "$step" = all ] || [ "$step" = eager ]; then
  # the public eager API (store.append + store.attend per layer) against the captured step at 1M, then where the
  # eager token's host time goes (cProfile, Triton launches) beside its kernels
  timeout 300 python3 -c 'from bench_longctx.cli import main; raise SystemExit(main())' bench e2e --preset h200 \
    --no-plots --set e2e.modes=topk,dense --set e2e.steps=64 --out "$out/e2e-eager" 2>&1 | tail -12
  timeout 200 python3 -m bench_longctx.step_profile --eager --context 131072 --steps 8 --out "$out" 2>&1 | tail -40
fi
if [ "$step" = all ] || [ "$step" = saves ]; then
  # a 512K context saved in the background while another sequence decodes, then the synchronous save
  timeout 300 python3 -m bench_longctx.save_pauses --preset h200 --save-tokens 512K --runs background \
    --out "$out/save_pauses_background.json" 2>&1 | tail -4
  timeout 200 python3 -m bench_longctx.save_pauses --preset h200 --save-tokens 512K --runs sync \
    --out "$out/save_pauses_sync.json" 2>&1 | tail -4
fi
if [ "$step" = all ] || [ "$step" = serve ]; then
  # row batches (joins and leaves without a capture), promotion on and off, all at once and Poisson arrivals
  bench() { timeout 300 python3 -c 'from bench_longctx.cli import main; raise SystemExit(main())' bench serve \
    --preset h200 --no-plots "$@" 2>&1 | tail -8; }
  bench --set serve.output_tokens=256 --out "$out/serve-12x128k"
  bench --set serve.output_tokens=256 --set serve.stores=kvtier --set serve.promotions_per_boundary=0 \
    --out "$out/serve-12x128k-no-promotion"
  bench --set serve.output_tokens=128 --set serve.requests=48 --set serve.contexts=32768 --set serve.arrival_rate=8 \
    --out "$out/serve-48x32k-poisson"
fi
if [ "$step" = all ] || [ "$step" = cascade ]; then
  # the cascade mode against topk at 1M (every token appended), then its needles at 256K and 1M
  timeout 300 python3 -c 'from bench_longctx.cli import main; raise SystemExit(main())' bench e2e --preset h200 \
    --no-plots --set e2e.modes=topk,cascade --set e2e.steps=64 --out "$out/e2e-cascade" 2>&1 | tail -12
  timeout 400 python3 -m bench_longctx.needle_selection --device cuda --contexts 262144,1048576 --budgets 4096 \
    --seeds 1 --out "$out/needles-cascade.json" 2>&1 | tail -8
fi
if [ "$step" = all ] || [ "$step" = formats ]; then
  # fp8 / int4 walks at 1M against SDPA, then e2e with an int4 warm tier and the serve trace's capacity with it
  timeout 200 python3 -m bench_longctx.kernel_bench --quick --out "$out" 2>&1 | tail -24
  timeout 300 python3 -c 'from bench_longctx.cli import main; raise SystemExit(main())' bench e2e --preset h200 \
    --no-plots --set e2e.modes=dense --set e2e.warm_format=int4 --set e2e.steps=16 --out "$out/e2e-int4" 2>&1 | tail -12
  timeout 400 python3 -c 'from bench_longctx.cli import main; raise SystemExit(main())' bench serve --preset h200 \
    --no-plots --set serve.output_tokens=128 --set serve.stores=kvtier --set serve.warm_format=int4 \
    --set serve.requests=24 --out "$out/serve-int4" 2>&1 | tail -8
fi
if [ "$step" = all ] || [ "$step" = fetch ]; then
  timeout 120 python3 -m bench_longctx.fetch_bench --out "$out/fetch_h200.json" 2>&1 | tail -4
fi
