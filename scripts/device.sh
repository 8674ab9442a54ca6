#!/usr/bin/env bash
# The one entry point for runs on the GPU machine: `bash scripts/device.sh PART...` from the repo root.
# Output goes to $OUT (the device tool's folder; default /tmp/device-out). Parts:
#   runtime   the runtime and std GPU tests, then `warploop bench runtime --json` -> $OUT/runtime-<device>-<date>.json
#   hostcall  the std and runtime GPU tests, then `warploop bench hostcall --json` -> $OUT/hostcall-<device>-<date>.json
#   bundle    build examples/kernels.py for every target, then `warploop bench bundle --json` -> $OUT/bundle-...json
#   hop       the runtime GPU tests, then `python -m warploop.bench.runtime_hop` -> $OUT/hop.json
#   examples  every example at its GPU size, then the examples', runtime's and coexistence GPU tests
#   tp        two GPUs: tensor parallelism and replicas (TP_PARTS, default below; scripts/bench_tp.py one part a
#             process, each under its own limit and all under DEADLINE_S) -> $OUT/tp-PART.json, $OUT/pytest.log;
#             TP_PARTS=stream: the streaming kernel's tensor parallelism (tests/test_stream_tp_gpu.py, then
#             scripts/stream_tp_time.py: one GPU against two) -> $OUT/tp-stream.json; one_stream, tp_stream: bench_tp.py's
#             engine on --backend stream; user_stream: `generate --backend stream` on tiny at TP 1 and 2;
#             TP_PARTS=serve: scripts/serve_load.py on Llama-3.1-8B shapes, tokens/s at 64 requests of one engine,
#             `warploop serve --replicas 2`, two Ray Serve replicas and the in-process peers ($SERVE_SYSTEMS), then
#             one engine at 32 (issue 36; run scripts/ray_payload.sh here first and carry .carry:
#             scripts/ray_install.sh installs it there) -> $OUT/serve-load.json, serve-load-c32.json,
#             $OUT/serve-load-logs/; TP_PARTS=serve_profile: the same for one and replicas with a py-spy on
#             each server process (serve_load.py --profile) -> $OUT/serve-profile.{json,tgz}
#   mk        the decode megakernel: scripts/device_mk.sh (its PART=... chooses within it)
#   stream    the streaming executor: scripts/device_stream.sh (its PART=... chooses within it)
#   prefill   the chunked-prefill engine tests, scripts/prefill_profile.py (the kernels of each system's prefill,
#             $PROFILE_MODELS), then `warploop bench prefill --json` for each of $MODELS (default all three; each
#             under $PREFILL_S, default 240; $PREFILL_ARGS adds to its arguments) -> $OUT/prefill-MODEL-<device>-<date>.json
#   soak      scripts/soak.py for $SOAK_MINUTES (default 8: a device call ends at 10 minutes) on the GPU, backend
#             $SOAK_BACKEND (default: the device's); carry .carry/whl (the server's wheels) -> $OUT/soak.json
# Commit a bench's JSON unedited as bench/results/<bench>-<device>-<YYYYMMDD>.json (BENCHMARKS.md).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OUT="${OUT:-/tmp/device-out}"; mkdir -p "$OUT"
if [ $# -eq 0 ] || [ "$1" = --help ] || [ "$1" = -h ]; then sed -n "2,26p" "$0" | cut -c3-; exit 0; fi

environment() {
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,persistence_mode --format=csv,noheader || true
  python -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
}
stamp() { echo "$(python -c 'from warploop.bench.common import device_slug; print(device_slug())')-$(date -u +%Y%m%d)"; }
gpu_tests() { timeout "${TEST_S:-300}" python -m pytest -q -p no:cacheprovider --timeout=300 "$@" 2>&1 | tee -a "$OUT/pytest.log" | tail -8; }

tp_part() {  # tp_part NAME LIMIT_S: one part of the two-GPU run in its own process
  local part=$1 limit=$2 left=$(( DEADLINE_S - ($(date +%s) - START) ))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 30 ]; then echo "tp $part skipped: ${left}s left"; return; fi
  case $part in
    tests) timeout -s ABRT -k 10 "$limit" python -m pytest -q -p no:cacheprovider -rf --tb=short --timeout=120 \
             tests/test_tp_gpu.py tests/test_tp_shard.py > "$OUT/pytest.log" 2>&1; echo "tests rc=$?"; tail -25 "$OUT/pytest.log" ;;
    user) for run in 1:auto 2:nccl 2:symm; do   # a user's generate, greedy, on tiny: TP=1 against each all-reduce
            echo "tensor-parallel ${run%%:*}, WARPLOOP_TP_ALLREDUCE=${run##*:}"
            WARPLOOP_TP_ALLREDUCE=${run##*:} timeout -s ABRT -k 10 "$limit" python -m warploop.cli generate --model tiny \
              --device cuda --prompt "def add(a, b):" --max-tokens 64 --temperature 0 --tensor-parallel "${run%%:*}" --json
          done 2>&1 | tee "$OUT/user.log" ;;
    stream) timeout -s ABRT -k 10 "$limit" python -m pytest -q -p no:cacheprovider -rf --tb=short --timeout=300 \
              tests/test_stream_tp_gpu.py > "$OUT/pytest-stream-tp.log" 2>&1; echo "stream tp tests rc=$?"
            tail -15 "$OUT/pytest-stream-tp.log"
            timeout -s ABRT -k 10 "$limit" python scripts/stream_tp_time.py --worlds 1,2 > "$OUT/tp-stream.json"
            echo "stream tp time rc=$?"; cat "$OUT/tp-stream.json" ;;
    user_stream) for n in 1 2; do   # the same generate on the streaming backend (bf16): one GPU against two ranks' kernels
            echo "tensor-parallel $n, --backend stream"
            timeout -s ABRT -k 10 "$limit" python -m warploop.cli generate --model tiny --device cuda --backend stream \
              --dtype bfloat16 --prompt "def add(a, b):" --max-tokens 64 --temperature 0 --tensor-parallel "$n" --json
          done 2>&1 | tee "$OUT/user-stream.log" ;;
    *_stream) timeout -s ABRT -k 10 "$limit" python scripts/bench_tp.py --part "${part%_stream}" --backend stream \
                > "$OUT/tp-$part.json"; echo "bench $part rc=$?"; cat "$OUT/tp-$part.json" ;;
    serve) # issue 36: Ray Serve's two replicas against `warploop serve` and its --replicas 2, at 64 requests. Ray
           # and the server's wheels come in .carry (scripts/ray_payload.sh); SIGTERM, not ABRT: the script then
           # stops the system it runs, and keeps what it measured in serve-load.json
           ( source scripts/ray_install.sh &&
             timeout -k 90 "$limit" python scripts/serve_load.py --shapes llama-3.1-8b --device cuda --timeout 240 \
               --systems "${SERVE_SYSTEMS:-one,replicas,ray,engine,pool}" --log-dir "$OUT/serve-load-logs" --save "$OUT/serve-load.json" > /dev/null
             # one engine at the load an engine gets in the two-replica systems: the ratio issue 36 asks for
             timeout -k 30 120 python scripts/serve_load.py --shapes llama-3.1-8b --device cuda --timeout 100 \
               --systems one,engine --concurrency 32 --save "$OUT/serve-load-c32.json" > /dev/null ); echo "serve load rc=$?"
           cat "$OUT/serve-load.json" "$OUT/serve-load-c32.json" ;;
    serve_profile) # where `warploop serve` spends the rounds (one engine, then --replicas 2): a py-spy on each of
           # its processes (the py-spy wheel in .carry/whl, installed with Ray's) -> $OUT/serve-profile.{json,tgz}
           ( source scripts/ray_install.sh &&
             timeout -k 90 "$limit" python scripts/serve_load.py --shapes llama-3.1-8b --device cuda --timeout 240 \
               --systems one,replicas --profile /tmp/serve-prof --py-spy "${RAY_SITE:-/tmp/ray-site}/bin/py-spy" \
               --save "$OUT/serve-profile.json" > /dev/null ); echo "serve profile rc=$?"
           tar czf "$OUT/serve-profile.tgz" -C /tmp serve-prof; cat "$OUT/serve-profile.json" ;;
    *) timeout -s ABRT -k 10 "$limit" python scripts/bench_tp.py --part "$part" > "$OUT/tp-$part.json"
       echo "bench $part rc=$?"; cat "$OUT/tp-$part.json" ;;
  esac
}

for part in "$@"; do
  echo "== $part $(date +%T)"
  case "$part" in
    runtime)
      environment; gpu_tests tests/test_runtime_gpu.py tests/test_std_gpu.py
      timeout "${BENCH_S:-300}" python -m warploop.cli bench runtime --json --out "$OUT/runtime-$(stamp).json" > /dev/null
      echo "bench runtime rc=$?" ;;
    hostcall)
      environment; gpu_tests tests/test_std_then.py tests/test_std_runtime.py tests/test_std_gpu.py tests/test_runtime_gpu.py
      timeout "${BENCH_S:-200}" python -m warploop.cli bench hostcall --json > "$OUT/hostcall-$(stamp).json"
      echo "bench hostcall rc=$?" ;;
    bundle)
      environment
      python -m warploop.cli bundle build examples/kernels.py -t cuda:80 -t cuda:90 -t cuda:100 -t hip:gfx90a \
        -t hip:gfx942 -t hip:gfx1100 -t cpu -o /tmp/kernels.wlb
      timeout "${BENCH_S:-300}" python -m warploop.cli bench bundle --json --bundle /tmp/kernels.wlb \
        --out "$OUT/bundle-$(stamp).json" > /dev/null
      echo "bench bundle rc=$?" ;;
    hop)
      environment; gpu_tests tests/test_runtime_gpu.py
      timeout "${HOP_S:-120}" python -m warploop.bench.runtime_hop "${HOPS:-2000}" > "$OUT/hop.json"
      echo "hop rc=$?"; head -c 2000 "$OUT/hop.json"; echo ;;
    examples)
      environment
      for ex in parallel_sort tree_reduce mlp_graph bundle_demo; do
        echo "examples/$ex.py"; timeout 400 python examples/$ex.py; echo "rc=$?"
      done
      timeout 200 python examples/gpu_grep.py "def " "$(python -c 'import json, os; print(os.path.dirname(json.__file__))')" | tail -2
      gpu_tests tests/test_examples_gpu.py tests/test_runtime_gpu.py tests/test_runtime_coexist_gpu.py tests/test_std_gpu.py \
        tests/test_runtime_dynamic_gpu.py ;;
    tp)
      export NCCL_NVLS_ENABLE=0 PYTHONFAULTHANDLER=1   # NVLink multicast stays off; a stalled part prints its stacks
      START=$(date +%s); DEADLINE_S=${DEADLINE_S:-570}
      environment; python -c "import torch; print('nccl', torch.cuda.nccl.version())"
      for p in ${TP_PARTS:-tests tp tp_symm one user replicas compile}; do
        case $p in tests) tp_part tests 200 ;; compile) tp_part compile 300 ;; stream) tp_part stream 500 ;;
                   serve|serve_profile) tp_part "$p" 450 ;;
                   *) tp_part "$p" 150 ;; esac
        if [ "$p" = tp ] && ! grep -q ms_per_token_bs1 "$OUT/tp-tp.json" 2>/dev/null; then tp_part tp_eager 120; fi
      done ;;
    mk) bash scripts/device_mk.sh ;;
    stream) bash scripts/device_stream.sh ;;
    soak)
      environment
      # the GPU image has no fastapi/uvicorn/httpx: their wheels travel in .carry/whl (carry it)
      if [ -d .carry/whl ]; then
        pip install -q --no-index --no-deps --target /tmp/wl-site .carry/whl/*.whl 2>/dev/null
        export PYTHONPATH="/tmp/wl-site:$PYTHONPATH"
      fi
      timeout $(( ${SOAK_MINUTES:-8} * 60 + 90 )) python scripts/soak.py --device cuda --minutes "${SOAK_MINUTES:-8}" \
        ${SOAK_BACKEND:+--backend "$SOAK_BACKEND"} > "$OUT/soak.json"; echo "soak rc=$?"; tail -c 2000 "$OUT/soak.json"; echo ;;
    prefill)
      environment; gpu_tests tests/test_chunked_prefill.py
      for m in ${PROFILE_MODELS:-llama-3.2-1b qwen3-0.6b}; do   # where each system's prefill time goes
        timeout 200 python scripts/prefill_profile.py --model "$m" > "$OUT/prefill-profile-$m.json"
        echo "profile $m rc=$?"; head -c 2500 "$OUT/prefill-profile-$m.json"; echo
      done
      models="${MODELS:-llama-3.2-1b,qwen3-0.6b,smollm2-135m}"
      for m in ${models//,/ }; do   # a process and a file each: one that runs
        # out of time loses only its own figures (Llama took about 170 s on the H200, Qwen3 more)
        timeout "${PREFILL_S:-240}" python -m warploop.cli bench prefill --json --models "$m" ${PREFILL_ARGS:-} \
          --save "$OUT/prefill-$m-$(stamp).json" > /dev/null 2> "$OUT/prefill-$m.stderr"
        echo "bench prefill $m rc=$?"; tail -n 12 "$OUT/prefill-$m.stderr"
      done ;;
    *) echo "device.sh: no part '$part' (bash scripts/device.sh --help lists them)" >&2; exit 2 ;;
  esac
done
