#!/usr/bin/env bash
# One H200 call: engine decode profile (scripts/gpu_engine_profile.py), then issue 4's speed
# benchmark: AWQ-quantize an 8-layer DeepSeek-V2-Lite-shaped random bf16 checkpoint on the GPU.
set -uo pipefail
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .wheels/*.whl
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
timeout "${PROFILE_S:-150}" python3 scripts/gpu_engine_profile.py "$OUT" ${PROFILE_SCHEMES:-bf16 int4} > "$OUT/profile.log" 2>&1
echo "profile rc=$?"; grep -v "^INFO" "$OUT/profile.log" | tail -5
W=$(mktemp -d)
python3 - "$W/v2lite8" <<'PY'
import sys, time
from dsquant.bench.random_model import V2_LITE, write_random_checkpoint
t = time.perf_counter()
write_random_checkpoint(sys.argv[1], {**V2_LITE, "num_hidden_layers": 8}, device="cuda")
print(f"wrote the 8-layer bf16 checkpoint in {time.perf_counter() - t:.1f} s")
PY
du -sh "$W/v2lite8"
cat > "$W/awq-v2lite.yaml" <<'Y'
name: awq-w4g128
default: {scheme: awq, bits: 4, group_size: 128}
keep: [lm_head, "*.embed_tokens", "*.mlp.gate", "*norm"]  # layer 0 down_proj (K 10944): group 64 (on_indivisible)
awq: {grid: 20, duo_scaling: true, clip: true, clip_grid: 20, max_shrink: 0.5}
Y
/usr/bin/time -v timeout "${QUANT_S:-330}" python3 -m dsquant quantize "$W/v2lite8" --recipe "$W/awq-v2lite.yaml" \
    -o "$W/awq" --device cuda > "$OUT/quantize.log" 2> "$OUT/quantize.err"
echo "quantize rc=$?"; tail -30 "$OUT/quantize.log"; grep -E "Elapsed|Maximum resident" "$OUT/quantize.err"; tail -5 "$OUT/quantize.err"
cp "$W/awq/dsquant.json" "$OUT/quantize_manifest.json" 2>/dev/null
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
