#!/usr/bin/env bash
# The streaming executor on the GPU machine, in one device call. Parts (PART=a,b,...; default tests,bench):
#   tests   the GPU tests (the kernel against the CPU reference node by node, the decode loop, --backend stream,
#           a transformers-written directory, a cold server within 10 s; carry .carry/whl)
#   bench   `warploop bench stream` (JSON to $OUT; BENCH_ARGS adds to its arguments)
#   step    each of $STEP_MODELS' whole decode step and 32-step loop (scripts/stream_step_time.py, context
#           $STEP_CONTEXT) -> $OUT/step-MODEL.json
#   decode  `warploop bench decode` for the stream backend against torch.compile, batch 1 and $DECODE_BATCHES (default
#           8; with WARPLOOP_STREAM_ROWS=N set, batches up to N run on the kernel) -> $OUT/decode.json
#   server  tests/test_server_gpu.py's 64 concurrent streams on `warploop serve --backend stream` (the
#           server's wheels from .carry/whl, as in scripts/device_mk.sh)
#   batch   each of $STEP_MODELS' batched step on the kernel at $BATCHES (default 8 32) rows, context $STEP_CONTEXT,
#           for each StreamConfig override in $BATCH_CONFIGS (JSON objects with no spaces inside, space-separated;
#           default '{}'; e.g.
#           '{} {"ring":4,"x_stage_kb":128}') -> $OUT/batch-MODEL-B-cN.json (tokens_per_s; `bench decode`'s per-op
#           and torch.compile are the peers)
#   ab      this tree against each of $AB_TREES (other checkouts inside it, carried: e.g. `git worktree add
#           base main`, carry ["base"]): each of $STEP_MODELS' batched step at $BATCHES rows from each tree in
#           turn, in one call -> $OUT/ab.jsonl (field `tree`)
#   options the GPU tests of the batched kernel's options (wgmma_pipe, attn_kv_split, gemv_tall, 64 rows), then
#           each of $STEP_MODELS' batched step at $BATCHES (default 32 8 64) for each option set in $OPTION_CONFIGS
#           (default: none, each alone, wgmma_pipe with attn_kv_split; a set a kernel refuses is skipped)
#           -> $OUT/options.jsonl
#   trace   the anatomy of each of $TRACE_MODELS' step from the kernel's clock (scripts/stream_trace.py)
#   prebuilt  the prebuilt and shipped kernels' GPU tests, then `bench decode` of the stream with
#           WARPLOOP_STREAM_PREBUILT=${PREBUILT:-auto} (the shipped kernels; or a folder) and an empty Triton
#           cache -> $OUT/decode-prebuilt.json (start_s: no stream kernel compiled)
#   cold    `warploop serve --model DIR`'s seconds to the first request's first token, empty Triton and warploop
#           caches, Triton blocked (scripts/serve_cold.py; the wheels from .carry/whl) -> $OUT/cold.json
#   faults  faults injected into the kernel's words under `--backend stream` (tests/test_server_gpu_faults.py;
#           the wheels from .carry/whl, as the server part)
#   ncu     Nsight Compute on one launch of $NCU_MODEL's (default llama-3.2-1b) step at $NCU_BATCH rows (default 8),
#           context $STEP_CONTEXT: the full set, then per-SASS-instruction stall samples (where the consumer's
#           warps wait) -> $OUT/ncu.ncu-rep, ncu-details.txt, ncu-sass.csv
#   bash scripts/device_stream.sh
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" CUDA_MODULE_LOADING=EAGER
OUT="${OUT:-/tmp/stream-out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
PART="${PART:-tests,bench}"
# the GPU image has no fastapi/uvicorn/httpx: the server's and its tests' wheels travel in .carry/whl (carry it),
# made here with pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .carry/whl
wheels() {
  if [ -d .carry/whl ] && [ ! -d /tmp/wl-site ]; then
    pip install -q --no-index --no-deps --target /tmp/wl-site .carry/whl/*.whl
  fi
  [ -d /tmp/wl-site ] && export PYTHONPATH="/tmp/wl-site:$PYTHONPATH"
  return 0
}
for part in ${PART//,/ }; do
  echo "== $part $(date +%T)"
  case "$part" in
    tests) wheels       # test_serve_cold_gpu.py serves
           (cd tests && timeout "${TEST_S:-450}" python -m pytest -q --timeout=240 test_stream_gpu.py test_stream_compile.py \
              test_weights_align.py test_serve_cold_gpu.py) || echo "tests: rc $?" ;;
    bench) timeout 500 python -m warploop.cli bench stream --json --out "$OUT/stream.json" ${BENCH_ARGS:-} \
             > "$OUT/stream.stdout" 2> "$OUT/stream.stderr"; echo "bench: rc $?"; tail -n 30 "$OUT/stream.stderr" ;;
    server) wheels
            (cd tests && timeout "${SERVER_S:-300}" python -m pytest -q --timeout=280 test_server_gpu.py -k stream) \
              || echo "server: rc $?" ;;
    trace) for m in ${TRACE_MODELS:-llama-3.2-1b qwen3-0.6b smollm2-135m}; do
             timeout 200 python scripts/stream_trace.py --model "$m" ${TRACE_ARGS:-} > "$OUT/trace-$m.json" \
               || echo "trace $m: rc $?"; python -c "import json,sys; d=json.load(open(sys.argv[1])); \
print(sys.argv[2], d['span_us'], d['per_cta_us'], json.dumps(d['stages']), json.dumps(d['stage_spans']))" "$OUT/trace-$m.json" "$m"; done ;;
    decode) timeout "${DECODE_S:-300}" python -m warploop.cli bench decode --json --skip hf_eager --skip warploop \
              --skip megakernel --batches "${DECODE_BATCHES:-8}" --no-ttft --save "$OUT/decode.json" > /dev/null \
              2> "$OUT/decode.stderr"
            echo "decode: rc $?"; tail -n 5 "$OUT/decode.stderr"
            python -c "import json,sys; r=json.load(open(sys.argv[1])); [print(n, 'floor', e['floor_ms'], \
{s: (e[s].get('ms_per_token_bs1'), e[s].get('ms_per_token_sampled_bs1')) for s in ('stream', 'torch_compile')}, \
e['ratios']) for n, e in r['models'].items()]" \
              "$OUT/decode.json" ;;
    batch) n=0; for cfg in ${BATCH_CONFIGS:-'{}'}; do n=$((n + 1))
           for bt in ${BATCHES:-8 32}; do for m in ${STEP_MODELS:-llama-3.2-1b qwen3-0.6b smollm2-135m}; do
             f="$OUT/batch-$m-$bt-c$n.json"
             timeout 200 python scripts/stream_step_time.py --model "$m" --context "${STEP_CONTEXT:-512}" --batch "$bt" \
               --loop 8 --runs 20 --config "$cfg" > "$f" || echo "batch $m $bt $cfg: rc $?"
             python -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['model'], 'batch', d['batch'], sys.argv[2], \
round(d['kernel_ms'], 4), 'ms', round(d['tokens_per_s']), 'tok/s', 'floor', round(d['floor_ms'], 4))" "$f" "$cfg"
           done; done; done ;;
    ab) for m in ${STEP_MODELS:-llama-3.2-1b qwen3-0.6b smollm2-135m}; do for bt in ${BATCHES:-8 32}; do
          for d in . ${AB_TREES:?AB_TREES names the checkouts to compare}; do
            rm -f /tmp/ab.json       # a failed run leaves no result, not the tree before's under this tree's name
            (cd "$d" && PYTHONPATH="$PWD" timeout 150 python scripts/stream_step_time.py --model "$m" \
               --context "${STEP_CONTEXT:-512}" --batch "$bt" --runs 20 --loop 4 > /tmp/ab.json) \
              || { echo "ab $d $m $bt: rc $?"; continue; }
            python -c "import json,sys; d=json.load(open('/tmp/ab.json')); d['tree']=sys.argv[1]; print(json.dumps(d)); \
print(d['tree'], d['model'], d['batch'], round(d['kernel_ms'], 4), 'ms', file=sys.stderr)" "$d" >> "$OUT/ab.jsonl"
          done; done; done ;;
    options) (cd tests && timeout "${TEST_S:-240}" python -m pytest -q --tb=short --timeout=150 test_stream_gpu.py \
                -k "batched_decoder or split_k or wgmma_pipe or kv_split or tall" 2>&1 | grep -E "^E |passed|failed|FAILED") \
               || echo "options tests: rc $?"
             for m in ${STEP_MODELS:-llama-3.2-1b qwen3-0.6b smollm2-135m}; do for bt in ${BATCHES:-32 8 64}; do
               for cfg in ${OPTION_CONFIGS:-'{}' '{"attn_kv_split":true}' '{"wgmma_pipe":true}' '{"gemv_tall":true}' \
                                            '{"wgmma_pipe":true,"attn_kv_split":true}'}; do
                 rm -f /tmp/opt.json
                 timeout 150 python scripts/stream_step_time.py --model "$m" --context "${STEP_CONTEXT:-512}" --batch "$bt" \
                   --runs 20 --loop 4 --config "$cfg" > /tmp/opt.json 2> /tmp/opt.err \
                   || { echo "options $m $bt $cfg: rc $? $(tail -n 1 /tmp/opt.err | cut -c1-160)"; continue; }
                 python -c "import json,sys; d=json.load(open('/tmp/opt.json')); d['options']=json.loads(sys.argv[1]); \
print(json.dumps(d)); print(d['model'], d['batch'], sys.argv[1], round(d['kernel_ms'], 4), 'ms', file=sys.stderr)" \
                   "$cfg" >> "$OUT/options.jsonl"
               done; done; done ;;
    prebuilt) (cd tests && timeout 200 python -m pytest -q --timeout=180 test_stream_gpu.py -k "prebuilt or shipped") \
                || echo "prebuilt test: rc $?"
              TRITON_CACHE_DIR="$(mktemp -d)" WARPLOOP_STREAM_PREBUILT="${PREBUILT:-auto}" timeout 300 \
                python -m warploop.cli bench decode --json --skip hf_eager --skip warploop --skip megakernel \
                --skip torch_compile --batches 8 --no-ttft --save "$OUT/decode-prebuilt.json" > /dev/null 2> "$OUT/prebuilt.stderr"
              echo "decode prebuilt: rc $?"; tail -n 5 "$OUT/prebuilt.stderr"
              python -c "import json,sys; r=json.load(open(sys.argv[1])); [print(n, e['stream'].get('start_s'), \
e['stream'].get('ms_per_token_bs1')) for n, e in r['models'].items()]" "$OUT/decode-prebuilt.json" ;;
    cold)   wheels      # `warploop serve`'s first token with empty caches, Triton blocked, then allowed if that fails
            timeout "${COLD_S:-400}" env -u CUDA_MODULE_LOADING python scripts/serve_cold.py --block-triton > "$OUT/cold.json" 2> "$OUT/cold.stderr" \
              || { echo "cold (Triton blocked): rc $?"; tail -n 40 "$OUT/cold.stderr"
                   timeout 300 env -u CUDA_MODULE_LOADING python scripts/serve_cold.py > "$OUT/cold-triton.json" 2>> "$OUT/cold.stderr"; }
            # again, each start with the placed programs the first left in warploop's cache (Triton's still empty)
            timeout 300 env -u CUDA_MODULE_LOADING python scripts/serve_cold.py --block-triton --warploop-cache /tmp/wl-cache \
              > /dev/null 2>&1; timeout 300 env -u CUDA_MODULE_LOADING python scripts/serve_cold.py --block-triton \
              --warploop-cache /tmp/wl-cache > "$OUT/cold-placed.json" 2>> "$OUT/cold.stderr"
            grep -v "^ " "$OUT/cold.stderr" | tail -n 8 ;;
    faults) wheels
            (cd tests && timeout "${FAULT_S:-400}" python -m pytest -q --timeout=300 test_server_gpu_faults.py) \
              || echo "faults: rc $?" ;;
    ncu) command -v ncu >/dev/null || { echo "ncu: not on the PATH"; continue; }
         timeout "${NCU_S:-420}" ncu --clock-control none -k regex:stream_kernel --launch-skip 2 --launch-count 1 \
           --set full -f -o "$OUT/ncu" python scripts/stream_step_time.py --model "${NCU_MODEL:-llama-3.2-1b}" \
           --context "${STEP_CONTEXT:-512}" --batch "${NCU_BATCH:-8}" --runs 1 --loop 1 > "$OUT/ncu.stdout" 2>&1 \
           || { echo "ncu: rc $?"; tail -n 20 "$OUT/ncu.stdout"; }
         if [ -f "$OUT/ncu.ncu-rep" ]; then
           ncu --import "$OUT/ncu.ncu-rep" --page details > "$OUT/ncu-details.txt" 2>&1
           ncu --import "$OUT/ncu.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu-sass.csv" 2>&1
           grep -E "Duration|Warp Cycles Per Issued|Issue Slots Busy|Stall|Memory Throughput" "$OUT/ncu-details.txt" | head -n 30
         fi ;;
    step) for m in ${STEP_MODELS:-llama-3.2-1b qwen3-0.6b smollm2-135m}; do
            timeout 200 python scripts/stream_step_time.py --model "$m" --context "${STEP_CONTEXT:-512}" ${STEP_ARGS:-} \
              > "$OUT/step-$m${STEP_TAG:-}.json" || echo "step $m: rc $?"; cat "$OUT/step-$m${STEP_TAG:-}.json"; done ;;
  esac
done
