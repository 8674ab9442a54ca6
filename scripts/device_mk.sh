#!/usr/bin/env bash
# The decode megakernel on the GPU machine, in one device call. Parts (PART=a,b,...; default bench):
#   compile - compile the resident kernel for each of $MODELS (comma-separated) at once, in parallel
#            processes (no launch), into the cache that comes back: a later call's bench then starts at once
#   tests  - tests/test_mk_gpu.py and tests/test_mk_diff.py (against the per-op backend, the CPU executor); their
#            kernels compile on the GPU machine unless carried: scripts/mk_cache.py --gpu-tests compiles them here
#   server - tests/test_server_gpu.py: 64 concurrent streams through `warploop serve --backend megakernel`
#   tiny   - `warploop generate` on the tiny model with each backend
#   probe  - scripts/mk_probe.py: device time per step at $PROBE_BATCHES (default "1 8 32") over $PROBE_CONTEXT
#            tokens of context (default 512; several: "100 512"), each plan of $PLANS for each model of $PROBE_MODELS (default
#            llama-3.2-1b) in its own process (PROBE_AB=1: a model's plans in one process, in turn); JSON to
#            $OUT/probe-N.json
#   ttft   - scripts/ttft_ab.py for each of $TTFT_MODELS (comma-separated; default the three bench models):
#            TTFT of a 1,024-token prompt, torch and the megakernel in turn; JSON to $OUT/ttft-MODEL.json
#   loop   - scripts/mk_loop_trace.py: the decode loop at batch 1 (tokens, host messages, a trace)
#   bench  - `warploop bench decode --json` for $MODELS (default llama-3.2-1b) with $BENCH_ARGS
#            (default: the megakernel and the per-op backend only); the JSON goes to $OUT
# Triton's cache travels: .carry/triton-cache.tgz (if carried) seeds it, and $OUT/triton-cache.tgz
# brings it back, so a plan compiled once (a minute or more per model shape) is not compiled again.
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
PROBE_MODELS="${PROBE_MODELS:-llama-3.2-1b}"
for part in ${PART//,/ }; do
  echo "== $part $(date +%T)"
  case "$part" in
    compile)
      for m in ${MODELS//,/ }; do
        python scripts/mk_probe.py --model "$m" --compile-only > "/tmp/compile-$m.log" 2>&1 &
      done
      wait
      tail -n 1 /tmp/compile-*.log ;;
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
    probe)
      # one process per plan of $PLANS (';'-separated JSON objects; default $WARPLOOP_MK_PLAN or {});
      # with PROBE_CACHED_ONLY=1 a plan whose kernel is not in the carried cache is skipped, not
      # compiled there (minutes of device time: compile it here with scripts/mk_cache.py)
      # and each model of $PROBE_MODELS (comma-separated, default llama-3.2-1b), models outer
      # PROBE_AB=1: every plan of a model in one process, timed in turn (mk_probe's p0_, p1_, ... keys):
      # backend options (fused_upto, graph_rows, ...) share one kernel and the turns see the same
      # weights; a plan of another kernel loads its own from the cache (since 9fcaf6c; before, Triton
      # 3.6 keyed the second kernel of a process differently and compiled it again)
      IFS=';' read -ra plans <<< "${PLANS:-${WARPLOOP_MK_PLAN:-{\}}}"
      i=0
      # probe_run MODEL PLAN...: one mk_probe process timing these plans in turn, into $OUT/probe-$i.json
      probe_run() {
        local model=$1 plan; shift
        i=$((i+1))
        for plan in "$@"; do
          if [ "${PROBE_CACHED_ONLY:-0}" = 1 ] && \
             ! timeout 30 python scripts/mk_probe.py --model "$model" --compile-only --plan "$plan"; then
            echo "$model, plan $plan: not in the cache, skipped"; return
          fi
        done
        echo "$model, plan(s) $*"
        # shellcheck disable=SC2086
        env -u WARPLOOP_MK_PLAN python scripts/mk_probe.py --model "$model" --plan "$@" \
          --batch ${PROBE_BATCHES:-1 8 32} --context ${PROBE_CONTEXT:-512} --repeat 10 > "$OUT/probe-$i.json"
        grep '^{"\(p[0-9]*_\)\?\(bs\|switching\)' "$OUT/probe-$i.json"
      }
      for model in ${PROBE_MODELS//,/ }; do
        if [ "${PROBE_AB:-0}" = 1 ]; then
          probe_run "$model" "${plans[@]}"
        else
          for plan in "${plans[@]}"; do probe_run "$model" "$plan"; done
        fi
      done ;;
    ttft)
      models="${TTFT_MODELS:-llama-3.2-1b,qwen3-0.6b,smollm2-135m}"
      for m in ${models//,/ }; do
        timeout -k 10 "${TTFT_LIMIT_S:-150}" python scripts/ttft_ab.py --model "$m" --rounds "${TTFT_ROUNDS:-10}" \
          > "$OUT/ttft-$m.json" || echo "ttft $m: rc $?"
        python -c "import json; r=json.load(open('$OUT/ttft-$m.json')); print('$m', {k: v for k, v in r.items() if k.endswith('median_ms') or '_over_' in k})" || true
      done ;;
    loop)
      # the decode loop at batch 1: N single steps against one loop request (tokens, host messages,
      # time per token), then a traced loop request (Perfetto, gzipped) into $OUT
      python scripts/mk_loop_trace.py --model "${LOOP_MODEL:-llama-3.2-1b}" --steps 32 | tee "$OUT/loop.json"
      python scripts/mk_loop_trace.py --model "${LOOP_MODEL:-llama-3.2-1b}" --steps 32 \
        --trace "$OUT/mk-loop-trace.json.gz" | tee "$OUT/loop-trace.json" ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
