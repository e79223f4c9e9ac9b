#!/usr/bin/env bash
# One H200 call for issue 24: the calibration plan (scripts/calib_plan.py: one dense + one MoE layer
# of DeepSeek-V3's shape, FP8 input, each recipe) and AWQ of the 8-layer V2-Lite-shaped checkpoint.
# Usage: scripts/gpu_calib.sh STEP...   steps: v3 v2lite8   (env V3_RECIPES, V3_S, V2_S)
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/dsquant_triton_cache}
OUT=${OUT:-out}; mkdir -p "$OUT"
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .wheels/*.whl 2>&1 | tail -2
export PYTHONPATH="$PWD:$SITE"
W=${WORK:-$(mktemp -d)}
for step in "$@"; do
  start=$(date +%s)
  case $step in
    v3) timeout "${V3_S:-330}" python3 scripts/calib_plan.py "$OUT/calib-plan-v3.json" --workdir "$W/v3" \
          --recipes "${V3_RECIPES:-awq-w4g128,rtn-w4g128}" --timeout "${V3_Q_S:-300}" > "$OUT/v3.txt" 2>&1
        echo "v3 rc=$?" >> "$OUT/v3.txt"; du -sh "$W"/v3/* >> "$OUT/v3.txt" 2>&1 ;;
    v2lite8)
        python3 - "$W/v2lite8" <<'PY'
import sys, time
from dsquant.bench.random_model import V2_LITE, write_random_checkpoint
t = time.perf_counter()
write_random_checkpoint(sys.argv[1], {**V2_LITE, "num_hidden_layers": 8}, device="cuda")
print(f"wrote the 8-layer bf16 checkpoint in {time.perf_counter() - t:.1f} s")
PY
        # V2_RECIPE=keep: the bundled awq-w4g128 with layer 0's down_proj (K = 10944) kept BF16 by hand
        printf '%s\n' 'name: awq-w4g128' 'default: {scheme: awq, bits: 4, group_size: 128}' \
          'keep: [lm_head, "*.embed_tokens", "*.mlp.gate", "*norm", "model.layers.0.mlp.down_proj"]' > "$W/keep.yaml"
        R=${V2_RECIPE:-awq-w4g128}; [ "$R" = keep ] && R="$W/keep.yaml"
        /usr/bin/time -v timeout "${V2_S:-200}" python3 -m dsquant quantize "$W/v2lite8" --recipe "$R" \
            -o "$W/awq" --device cuda > "$OUT/v2lite8.log" 2> "$OUT/v2lite8.err"
        echo "quantize rc=$?" >> "$OUT/v2lite8.log"
        cp "$W/awq/dsquant.json" "$OUT/v2lite8-manifest.json" 2>/dev/null ;;
    *) echo "unknown step $step" ;;
  esac
  echo "== $step: $(( $(date +%s) - start )) s" | tee -a "$OUT/steps.txt"
done
cat "$OUT/v3.txt" 2>/dev/null | tail -8; tail -25 "$OUT/v2lite8.log" 2>/dev/null
grep -E "Elapsed|Maximum resident" "$OUT/v2lite8.err" 2>/dev/null; tail -3 "$OUT/v2lite8.err" 2>/dev/null
