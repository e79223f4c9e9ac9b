#!/usr/bin/env bash
# One H200 call for issue 17: the named pytest files on the code of 57581c7 (the dsquant files kept
# under .old/ swapped in) and on this tree, then `dsquant demo --device cuda` and a CPU validate
# of the same GPU-made artifacts. Logs under $OUT.
# Usage: TESTS="tests/kernels/test_fp8_cublas.py ..." scripts/gpu_fp8_fix.sh STEP...
#   steps: old new demo probe gemm moe engine trained serve (benches: FP8 beside its peers, fixed path),
#   kvfp8 (the FP8-KV-cache decode rows of bench attention), tune1 tune4 (dsquant tune of dsq-tiny-v3 on the GPU at --max-ppl-increase 1 / 4, issue 25)
# .old/ (ignored) holds the old versions: for f in FILES; do mkdir -p .old/$(dirname $f);
#   git show 57581c7:$f > .old/$f; done; carry .old and .wheels (../shared/wheels/h200-cp312).
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/dsquant_triton_cache}
OUT=${OUT:-out}; mkdir -p "$OUT"
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .wheels/*.whl 2>&1 | tail -2
export PYTHONPATH="$PWD:$SITE"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.version.cuda)" | tee -a "$OUT/gpu.txt"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n ${WORKERS:-4}"
swap() {  # swap the files under .old/ with the tree's
  for f in $(cd .old && find dsquant -name '*.py'); do
    cp "$f" "/tmp/swap.$$" && cp ".old/$f" "$f" && cp "/tmp/swap.$$" ".old/$f"
  done
}
for step in "$@"; do
  start=$(date +%s)
  case $step in
    old) swap; timeout "${TEST_S:-200}" python3 -m pytest -q -m gpu $XD -p no:cacheprovider ${TESTS} \
           --timeout 180 -rf 2>&1 | tail -${TAIL:-60} > "$OUT/tests-old.txt"; swap ;;
    new) timeout "${TEST_S:-200}" python3 -m pytest -q -m gpu $XD -p no:cacheprovider ${TESTS} \
           --timeout 180 -rf -s 2>&1 | tail -${TAIL:-80} > "$OUT/tests-new.txt" ;;
    demo) timeout "${DEMO_S:-300}" python3 -m dsquant demo --device cuda --out /tmp/demo > "$OUT/demo-cuda.txt" 2>&1
          echo "demo rc=$?" >> "$OUT/demo-cuda.txt"
          timeout "${CPUVAL_S:-200}" python3 -m dsquant validate /tmp/demo/fp8-block /tmp/demo/mixed-fp8attn-w4experts \
             /tmp/demo/awq-w4g128 /tmp/demo/gptq-w4g128 --baseline dsquant/assets/models/dsq-tiny-v3 \
             --device cpu --no-latency --no-peers --window 512 --stride 256 --max-eval-tokens 16384 \
             --out /tmp/demo-cpu > "$OUT/demo-cpu-validate.txt" 2>&1
          echo "cpu validate rc=$?" >> "$OUT/demo-cpu-validate.txt"
          cp /tmp/demo/report/report.json "$OUT/demo-cuda-report.json" 2>/dev/null
          cp /tmp/demo-cpu/report.json "$OUT/demo-cpu-report.json" 2>/dev/null ;;
    trained) timeout "${TRAINED_S:-540}" python3 -m pytest -q -p no:cacheprovider tests/runtime/test_gpu_trained_accuracy.py \
           --timeout 530 -rfE -s --tb=short > "$OUT/trained.txt" 2>&1 ;;
    serve) timeout "${SERVE_S:-400}" python3 -m dsquant bench engine --schemes ${SERVE_SCHEMES:-fp8} --modes async \
           --peer-batches "" --serve ${SERVE_C:-1,8,32,64} --json "$OUT/serve.json" > "$OUT/serve.txt" 2>&1 ;;
    tune1|tune4) b=${step#tune}; timeout "${TUNE_S:-290}" python3 -m dsquant tune dsquant/assets/models/dsq-tiny-v3 \
           --device cuda --max-ppl-increase "$b" --batch 1,64 --latency-cache /tmp/tune-latency -o /tmp/tune-b$b \
           > "$OUT/tune-b$b.txt" 2>&1; echo "tune rc=$?" >> "$OUT/tune-b$b.txt"; 
         mkdir -p "$OUT/tune-b$b"; (cd /tmp/tune-b$b && cp -r tune.json tune.md pareto.png recipe.yaml validate \
           /tmp/tune-latency "$OUT/tune-b$b/" 2>/dev/null) ;;
    kvfp8) timeout "${KV_S:-200}" python3 -c "
import torch
from dsquant.bench.attention import _print
from dsquant.bench.attention_fp8 import fp8_rows
from dsquant.bench.common import write_json
rows = fp8_rows(64, torch.Generator().manual_seed(0), lambda r: _print([r]))
write_json('$OUT/kvfp8.json', rows, {'block_size': 64})" > "$OUT/kvfp8.txt" 2>&1 ;;
    probe) timeout 120 python3 scripts/fp8_cublas_probe.py "$OUT/fp8-cublas-probe.json" > "$OUT/probe.txt" 2>&1 ;;
    gemm) timeout "${GEMM_S:-150}" python3 -m dsquant bench gemm --rep-ms 20 --m 1,4,64,1024,4096 \
            --json "$OUT/gemm.json" > "$OUT/gemm.txt" 2>&1 ;;
    moe) timeout "${MOE_S:-120}" python3 -m dsquant bench moe --formats bf16,fp8 --json "$OUT/moe.json" > "$OUT/moe.txt" 2>&1 ;;
    engine) timeout "${ENGINE_S:-300}" python3 -m dsquant bench engine --schemes bf16,fp8 --modes async \
            --peer-batches "" ${ENGINE_ARGS:-} --json "$OUT/engine.json" > "$OUT/engine.txt" 2>&1 ;;
    *) echo "unknown step $step" ;;
  esac
  echo "== $step: $(( $(date +%s) - start )) s" | tee -a "$OUT/steps.txt"
done
tail -24 "$OUT/kvfp8.txt" 2>/dev/null; tail -3 "$OUT"/tune-b*.txt 2>/dev/null; tail -5 "$OUT"/tests-*.txt 2>/dev/null; cat "$OUT/probe.txt" 2>/dev/null; tail -4 "$OUT/gemm.txt" "$OUT/moe.txt" 2>/dev/null; tail -12 "$OUT/engine.txt" 2>/dev/null; tail -40 "$OUT/trained.txt" "$OUT/serve.txt" 2>/dev/null; grep -A14 "perplexity\|ppl" "$OUT/demo-cuda.txt" 2>/dev/null | tail -16; tail -14 "$OUT/demo-cpu-validate.txt" 2>/dev/null
# what comes back is limited in files: everything in one archive (steps.txt beside it)
(cd "$OUT" && tar -czf /tmp/all.tgz --exclude=steps.txt . && find . -mindepth 1 ! -name steps.txt -delete && mv /tmp/all.tgz .)
