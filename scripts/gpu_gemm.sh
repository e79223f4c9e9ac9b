#!/usr/bin/env bash
# Issue 9 on the GPU: kernel tests, tuning sweep (optional), `dsquant bench gemm`; logs under $OUT.
# Usage: scripts/gpu_gemm.sh [tests] [sweep] [minibench] [bench] [cache]   (default: sweep bench tests)
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/dsquant_triton_cache}
OUT=${OUT:-out}; mkdir -p "$OUT"
steps=${*:-sweep bench tests}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
for step in $steps; do
  start=$(date +%s)
  case $step in
    tests) timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_w4a16_gemm.py \
             tests/kernels/test_fp8_gemm.py 2>&1 | tee "$OUT/tests.txt" | tail -30 ;;
    sweep) timeout 240 python3 scripts/gemm_sweep.py "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.txt" ;;
    minibench) timeout 60 python3 -m dsquant bench gemm --shapes 7168x4096 --m 1,1024 --rep-ms 20 \
             --json "$OUT/minibench.json" 2>&1 | tee "$OUT/minibench.txt" ;;
    bench) cfg=""; [ -s "$OUT/sweep.json" ] && cfg="--configs $OUT/sweep.json"
           timeout 200 python3 -m dsquant bench gemm --rep-ms 25 $cfg --json "$OUT/bench.json" 2>&1 \
             | tee "$OUT/bench.txt" ;;
    cache) tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" . && ls -la "$OUT/triton_cache.tgz" ;;
  esac
  echo "== $step: rc=$? in $(( $(date +%s) - start )) s" | tee -a "$OUT/steps.txt"
done
