#!/usr/bin/env bash
# The decode megakernel on the GPU machine: correctness first (against the per-op backend), then
# ms/token against the per-op torch backend on the tiny model, in one device call:
#   bash scripts/device_mk.sh
set -euo pipefail
# No CUDA_MODULE_LOADING setting: the runtime parks when idle, so first-use module loads complete beside it.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
cd tests
python -m pytest -q -x --timeout=300 test_mk_gpu.py
cd ..
for backend in torch megakernel; do
  python -m warploop.cli generate --model tiny --prompt "def main(" --max-tokens 64 --json --backend "$backend" \
    | python -c "import json,sys; r=json.load(sys.stdin); print('$backend', 'ms/token', r['ms_per_token'], 'ttft_ms', r['ttft_ms'], r['token_ids'][:8])"
done
