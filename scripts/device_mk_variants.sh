#!/usr/bin/env bash
# Megakernel tile variants on the GPU machine in one call: compile every variant in parallel into
# Triton's cache (no launch), then time each one alone (scripts/mk_probe.py). Results in $OUT.
#   bash scripts/device_mk_variants.sh
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/mk-out}"; mkdir -p "$OUT"
export TRITON_CACHE_DIR=/tmp/wl-triton-cache
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .carry/triton-cache.tgz ]; then tar xzf .carry/triton-cache.tgz -C "$TRITON_CACHE_DIR"; fi
MODEL="${MODEL:-llama-3.2-1b}"
VARIANTS=${VARIANTS:-'{} {"depth":8}'}
EXTRA=${EXTRA:-}      # "model plan" pairs compiled too (for a later bench), e.g. 'qwen3-0.6b {"depth":8}'
S=$(date +%s)
i=0
for v in $VARIANTS; do
  python scripts/mk_probe.py --model "$MODEL" --plan "$v" --compile-only > "$OUT/compile-$i.json" 2>&1 &
  i=$((i + 1))
done
set -- $EXTRA
while [ $# -ge 2 ]; do
  python scripts/mk_probe.py --model "$1" --plan "$2" --compile-only > "$OUT/compile-$i.json" 2>&1 &
  i=$((i + 1)); shift 2
done
wait
echo "compiled in $(( $(date +%s) - S ))s"; tail -n 2 "$OUT"/compile-*.json
tar czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" .
# TIME_PLANS: the plans to time (default: each variant at each of $WORKERS)
if [ -z "${TIME_PLANS:-}" ]; then
  TIME_PLANS=""
  for v in $VARIANTS; do
    for workers in ${WORKERS:-default 263}; do
      if [ "$workers" = default ]; then TIME_PLANS="$TIME_PLANS $v"
      else TIME_PLANS="$TIME_PLANS $(python -c "import json,sys; d=json.loads(sys.argv[1]); d['workers']=int(sys.argv[2]); print(json.dumps(d, separators=(',', ':')))" "$v" "$workers")"; fi
    done
  done
fi
i=0
for plan in $TIME_PLANS; do
  timeout "${TIME_LIMIT:-90}" python scripts/mk_probe.py --model "$MODEL" --plan "$plan" --batch ${BATCHES:-1 8} > "$OUT/time-$i.json" 2>&1
  echo "$plan rc=$? $(grep -h '^{"bs' "$OUT/time-$i.json" | python -c "
import json, sys
for line in sys.stdin:
    for k, v in json.loads(line).items():
        print(k, 'device', v['device_us_per_step'], v['device_runs_us'], 'decode', v['decode_wall_us'], 'run', v['graph_run_wall_us'],
              'relaunch', v.get('relaunches_in_50_decodes'), v.get('last_resume_us'), 'nodes', v['nodes'], end='; ')
")"
  tail -n 3 "$OUT/time-$i.json" | grep -i error || true
  i=$((i + 1))
done
echo "done in $(( $(date +%s) - S ))s"
