#!/usr/bin/env bash
# One H200 call running the named steps in order, each under its own time limit; logs and JSON
# under $OUT (steps.txt has each step's exit code and seconds).
# Usage: scripts/gpu_session.sh STEP...   steps: gputests kerneltests gemv gemm moe attention engine
#   env: WORKERS (pytest-xdist workers, default 4), TESTS (pytest paths for kerneltests)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/dsquant_triton_cache}
OUT=${OUT:-out}; mkdir -p "$OUT"
W=${WORKERS:-4}
if ls .wheels/*.whl >/dev/null 2>&1; then
  SITE=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .wheels/*.whl .wheels-extra/*.whl 2>/dev/null
  export PYTHONPATH="$PWD:$SITE"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
git log --oneline -1 2>/dev/null | tee -a "$OUT/gpu.txt"
for step in "$@"; do
  start=$(date +%s)
  case $step in
    gputests) timeout "${GPU_TESTS_S:-300}" python3 -m pytest -q -m gpu -n "$W" -p no:cacheprovider tests/ \
                --timeout 200 2>&1 | tail -40 > "$OUT/gputests.txt" ;;
    kerneltests) timeout "${KT_S:-200}" python3 -m pytest -q -m gpu -n "$W" -p no:cacheprovider ${TESTS:-tests/kernels} \
                --timeout 150 2>&1 | tail -40 > "$OUT/kerneltests.txt" ;;
    gemv) timeout "${GEMV_S:-240}" python3 scripts/gemv_sweep.py "$OUT/gemv_sweep.json" ${GEMV_ARGS:-} > "$OUT/gemv.txt" 2>&1 ;;
    gemm) timeout "${GEMM_S:-200}" python3 -m dsquant bench gemm --rep-ms 25 --json "$OUT/gemm.json" > "$OUT/gemm.txt" 2>&1 ;;
    moe) timeout "${MOE_S:-150}" python3 -m dsquant bench moe --json "$OUT/moe.json" ${MOE_ARGS:-} > "$OUT/moe.txt" 2>&1 ;;
    attention) timeout "${ATT_S:-200}" python3 -m dsquant bench attention --sweep --peer-gb 100 \
                --json "$OUT/attention.json" > "$OUT/attention.txt" 2>&1 ;;
    engine) timeout "${ENGINE_S:-300}" python3 -m dsquant bench engine ${ENGINE_ARGS:---schemes int4,bf16,fp8} \
                --json "$OUT/engine.json" > "$OUT/engine.txt" 2>&1 ;;
    *) echo "unknown step $step" ;;
  esac
  echo "== $step: rc=$? in $(( $(date +%s) - start )) s" | tee -a "$OUT/steps.txt"
done
