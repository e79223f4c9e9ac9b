#!/usr/bin/env bash
# One H200 call: install the carried wheels, then run the GPU-marked tests and the kernel and
# runtime tests at full size on the device (no TRITON_INTERPRET there). Logs go under $OUT.
set -uo pipefail
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .wheels/*.whl
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
timeout "${GPU_TESTS_S:-190}" python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider tests/ --timeout 150 \
    --junitxml="$OUT/gpu_marked.xml" 2>&1 | tail -40 | tee "$OUT/gpu_marked.txt"
timeout "${REST_S:-110}" python3 -m pytest -q -m "not gpu" -n 12 -p no:cacheprovider tests/kernels tests/runtime \
    --timeout 100 --junitxml="$OUT/rest.xml" 2>&1 | tail -25 | tee "$OUT/rest.txt"
