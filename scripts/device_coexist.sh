#!/usr/bin/env bash
# On the GPU machine: the runtime's GPU tests, its coexistence with torch, and the park handshake.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pytest -q -x --timeout=300 tests/test_runtime_coexist_gpu.py tests/test_runtime_gpu.py tests/test_std_gpu.py \
    -p no:cacheprovider 2>&1 | tee "$OUT/device-coexist-tests.log"
