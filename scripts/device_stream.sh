#!/usr/bin/env bash
# The streaming executor on the GPU machine, in one device call: the GPU tests, then
# `warploop bench stream` (JSON to $OUT), then the anatomy of each model's step from the kernel's
# clock (scripts/stream_trace.py, $OUT/trace-MODEL.json); PART=step times a model's whole decode step
# (scripts/stream_step_time.py); PART=loop checks the decode loop and --backend stream on the GPU,
# then times each model's step and loop. BENCH_ARGS adds to the bench's arguments.
#   bash scripts/device_stream.sh
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" CUDA_MODULE_LOADING=EAGER
OUT="${OUT:-/tmp/stream-out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
PART="${PART:-tests,bench}"
for part in ${PART//,/ }; do
  echo "== $part $(date +%T)"
  case "$part" in
    tests) (cd tests && timeout 300 python -m pytest -q -x --timeout=120 test_stream_gpu.py test_stream_compile.py) \
             || echo "tests: rc $?" ;;
    bench) timeout 500 python -m warploop.cli bench stream --json --out "$OUT/stream.json" ${BENCH_ARGS:-} \
             > "$OUT/stream.stdout" 2> "$OUT/stream.stderr"; echo "bench: rc $?"; tail -n 30 "$OUT/stream.stderr" ;;
    trace) for m in ${TRACE_MODELS:-llama-3.2-1b qwen3-0.6b smollm2-135m}; do
             timeout 200 python scripts/stream_trace.py --model "$m" ${TRACE_ARGS:-} > "$OUT/trace-$m.json" \
               || echo "trace $m: rc $?"; python -c "import json,sys; d=json.load(open(sys.argv[1])); \
print(sys.argv[2], d['span_us'], d['per_cta_us'], json.dumps(d['stages']), json.dumps(d['stage_spans']))" "$OUT/trace-$m.json" "$m"; done ;;
    loop) (cd tests && timeout 200 python -m pytest -q -x --timeout=120 test_stream_gpu.py -k "step or backend") \
             || echo "loop tests: rc $?"
          for m in ${STEP_MODELS:-llama-3.2-1b qwen3-0.6b smollm2-135m}; do
            timeout 100 python scripts/stream_step_time.py --model "$m" --context "${STEP_CONTEXT:-512}" \
              > "$OUT/step-$m.json" || echo "step $m: rc $?"; cat "$OUT/step-$m.json"; done ;;
    step) for m in ${STEP_MODELS:-llama-3.2-1b}; do
            timeout 200 python scripts/stream_step_time.py --model "$m" --context "${STEP_CONTEXT:-512}" \
              > "$OUT/step-$m.json" || echo "step $m: rc $?"; cat "$OUT/step-$m.json"; done ;;
  esac
done
