#!/usr/bin/env bash
# On the GPU machine, one call: every example at its GPU size, then the runtime's GPU tests.
#   bash scripts/device_examples.sh          (logs in $OUT when set)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
for ex in parallel_sort tree_reduce mlp_graph bundle_demo; do
    echo "== examples/$ex.py"; timeout 400 python3 examples/$ex.py; echo "rc=$?"
done
echo "== examples/gpu_grep.py"; timeout 200 python3 examples/gpu_grep.py "def " "$(python3 -c 'import json, os; print(os.path.dirname(json.__file__))')" | tail -2
python3 -m pytest -q --timeout=400 -p no:cacheprovider tests/test_examples_gpu.py tests/test_runtime_gpu.py \
    tests/test_runtime_coexist_gpu.py tests/test_std_gpu.py tests/test_runtime_dynamic_gpu.py 2>&1 | tee "$OUT/device-examples-tests.log" | tail -15
