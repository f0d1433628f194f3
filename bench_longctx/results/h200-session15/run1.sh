#!/usr/bin/env bash
# Session 15, call 1: variants of the int8 walk (walk_variants.py), the partition walk's kernels per call
# (mixed_parts.py, session 14's plan plus the int8 pool alone), the GPU step tests after session 14's last edits, and
# Nsight Compute on the walk if the machine has it. Pattern as ../h200-session14/run8.sh.
set -uo pipefail
mkdir -p /tmp/w && rm -rf /tmp/w/* && tar -xf .snap/head.tar -C /tmp/w && cp .snap/rev /tmp/w/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/w
R=/tmp/res1; mkdir -p $R; cp /tmp/w/REV $R/
save() { tar -czf $OUT/res1.tgz -C /tmp res1; }
cd /tmp/w
S=bench_longctx/results/h200-session15
NCU=$(which ncu 2>/dev/null || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
(echo "ncu: $NCU"; which nsys; ls /usr/local/cuda*/bin 2>&1 | head -30; nvidia-smi) > $R/tools.log 2>&1; save
timeout 200 python3 $S/walk_variants.py $R/variants > $R/variants.log 2>&1; save
timeout 120 python3 $S/mixed_parts.py $R/mixed > $R/mixed.log 2>&1; save
timeout 120 python3 -m pytest -q -p no:cacheprovider -m cuda tests/kvstore/test_step.py tests/kvstore/test_step_dense.py > $R/tests_step.log 2>&1; save
if [ -n "$NCU" ]; then
  timeout 150 $NCU --clock-control none --kernel-name regex:int8_split --launch-skip 2 --launch-count 1 --set full --import-source yes \
    -o $R/walk python3 $S/walk_once.py > $R/ncu.log 2>&1
  $NCU -i $R/walk.ncu-rep --page details --print-details all > $R/ncu_details.txt 2>&1
  $NCU -i $R/walk.ncu-rep --page source --csv --print-source sass 2>&1 | gzip > $R/ncu_source.csv.gz
  rm -f $R/walk.ncu-rep; save
fi
echo done > $R/DONE; save
