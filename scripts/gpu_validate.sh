#!/usr/bin/env bash
# One H200 call (issue 6): validate INT4 (RTN g128) and FP8-block artifacts of an 8-layer
# DeepSeek-V2-Lite-shaped random bf16 model against that BF16 model, latency included.
set -uo pipefail
SITE=$(mktemp -d)
[ -n "${SKIP_WHEELS:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .wheels/*.whl
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
W=$(mktemp -d)
LAYERS=${LAYERS:-8}
python3 -c "
import sys
from dsquant.bench.random_model import V2_LITE, write_random_checkpoint
write_random_checkpoint('$W/bf16', {**V2_LITE, 'num_hidden_layers': $LAYERS, **${CFG:-{\}}}, device='${DEV:-cuda}')"
cat > "$W/rtn.yaml" <<'Y'
name: rtn-w4g128
default: {scheme: rtn, bits: 4, group_size: 128}
keep: [lm_head, "*.embed_tokens", "*.mlp.gate", "*norm", "model.layers.0.mlp.down_proj"]
Y
for r in "$W/rtn.yaml:int4-rtn" "fp8-block:fp8-block"; do
  timeout 200 python3 -m dsquant quantize "$W/bf16" --recipe "${r%%:*}" -o "$W/${r##*:}" --device "${DEV:-cuda}" \
      ${QARGS:-} > "$OUT/quantize-${r##*:}.log" 2>&1
  echo "quantize ${r##*:} rc=$?"; tail -3 "$OUT/quantize-${r##*:}.log"
done
timeout "${VALIDATE_S:-300}" python3 -m dsquant validate "$W/int4-rtn" "$W/fp8-block" --baseline "$W/bf16" \
    --out "$OUT/validate" --device "${DEV:-cuda}" ${VARGS:-} > "$OUT/validate.log" 2>&1
echo "validate rc=$?"; tail -40 "$OUT/validate.log"
