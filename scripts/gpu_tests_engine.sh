#!/usr/bin/env bash
# One H200 call: the GPU test suite (scripts/gpu_all.sh), then the engine benchmark with HTTP runs.
set -uo pipefail
GPU_TESTS_S=${GPU_TESTS_S:-200} REST_S=${REST_S:-100} bash scripts/gpu_all.sh
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .wheels/*.whl
for mod in httpx httpcore h11 anyio sniffio certifi idna; do
  python3 -c "import $mod" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \
    --target "$SITE" .wheels-extra/${mod}-*.whl
done
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
timeout "${ENGINE_S:-250}" python3 -m dsquant bench engine --schemes int4,bf16,fp8 --serve 1,8,32,64 \
    --peer-batches "" --json "$OUT/engine.json" > "$OUT/engine.log" 2>&1
echo "engine rc=$?"; grep -v "attention mask" "$OUT/engine.log" | tail -8
