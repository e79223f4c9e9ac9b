#!/usr/bin/env bash
# One H200 call: the engine benchmark (issue 8) with the HTTP serving runs (issue 5) on the
# V2-Lite-shaped random model, then the long-context request. Results under $OUT.
set -uo pipefail
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .wheels/*.whl
for mod in httpx httpcore h11 anyio sniffio certifi idna; do  # the bench client's, only where missing
  python3 -c "import $mod" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \
    --target "$SITE" .wheels-extra/${mod}-*.whl
done
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout "${ENGINE_S:-420}" python3 -m dsquant bench engine --schemes "${SCHEMES:-int4,fp8,bf16}" \
    --serve 1,8,32,64 --peer-batches "${PEER:-1,16}" --json "$OUT/engine.json" > "$OUT/engine.log" 2>&1
echo "engine rc=$?" | tee -a "$OUT/gpu.txt"
tail -30 "$OUT/engine.log"
timeout "${LONG_S:-150}" python3 -m dsquant bench engine --schemes int4 --concurrency 0 --batch1-output 8 \
    --long-context 131072 --peer-batches "" --json "$OUT/long.json" > "$OUT/long.log" 2>&1
echo "long rc=$?" | tee -a "$OUT/gpu.txt"
tail -8 "$OUT/long.log"
