#!/usr/bin/env bash
# The decode megakernel on the GPU machine, in one device call. Parts (PART=a,b,...; default bench):
#   tests  - tests/test_mk_gpu.py and tests/test_mk_diff.py (against the per-op backend, the CPU executor); their
#            kernels compile on the GPU machine unless carried: scripts/mk_cache.py --gpu-tests compiles them here
#   server - tests/test_server_gpu.py: 64 concurrent streams through `warploop serve --backend megakernel`
#   tiny   - `warploop generate` on the tiny model with each backend
#   bench  - `warploop bench decode --json` for $MODELS (default llama-3.2-1b) with $BENCH_ARGS
#            (default: the megakernel and the per-op backend only); the JSON goes to $OUT
# Triton's cache travels: .carry/triton-cache.tgz (if carried) seeds it, and $OUT/triton-cache.tgz
# brings it back, so a plan compiled once (a minute or more per model shape) is not compiled again;
# compile here first with scripts/mk_cache.py and carry the packed cache.
#   bash scripts/device_mk.sh
set -euo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/mk-out}"; mkdir -p "$OUT"
export TRITON_CACHE_DIR=/tmp/wl-triton-cache WARPLOOP_PORTABLE_CACHE=1   # a cache packed by scripts/mk_cache.py is found
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .carry/triton-cache.tgz ]; then tar xzf .carry/triton-cache.tgz -C "$TRITON_CACHE_DIR"; fi
save_cache() { tar czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" . || true; }
trap save_cache EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader || true
python -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
PART="${PART:-bench}"
for part in ${PART//,/ }; do
  echo "== $part $(date +%T)"
  case "$part" in
    tests)
      (cd tests && python -m pytest -q -x --timeout=540 test_mk_gpu.py test_mk_diff.py) || echo "tests: rc $?" ;;
    server)
      # the GPU image has no fastapi/uvicorn/pydantic: carry their wheels in .carry/whl, made here with
      #   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .carry/whl \
      #     fastapi uvicorn pydantic
      if [ -d .carry/whl ]; then
        pip install -q --no-index --no-deps --target /tmp/wl-site .carry/whl/*.whl
        export PYTHONPATH="/tmp/wl-site:$PYTHONPATH"
      fi
      (cd tests && python -m pytest -q -x --timeout=900 test_server_gpu.py) || echo "server: rc $?" ;;
    tiny)
      # each backend, then the default (no --backend: the megakernel on a GPU that supports it)
      for backend in torch megakernel default; do
        flag=(--backend "$backend"); [ "$backend" = default ] && flag=()
        python -m warploop.cli generate --model tiny --prompt "def main(" --max-tokens 64 --json "${flag[@]}" \
          | python -c "import json,sys; r=json.load(sys.stdin); print('$backend:', r['backend'], 'ms/token', r['ms_per_token'], 'ttft_ms', r['ttft_ms'], r['token_ids'][:8])"
      done ;;
    bench)
      # shellcheck disable=SC2086
      python -m warploop.cli bench decode --json --models "${MODELS:-llama-3.2-1b}" \
        ${BENCH_ARGS:---skip hf_eager --skip torch_compile} --save "$OUT/decode.json" > /dev/null
      python -c "
import json; r = json.load(open('$OUT/decode.json'))
for name, e in r['models'].items():
    print(name, 'floor_ms', e['floor_ms'], json.dumps({k: v for k, v in e.items() if k not in ('model',)}, default=str)[:3000])
" ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
