#!/usr/bin/env bash
# scripts/gemv_share.py on the GPU machine for both second-stage shapes; JSON into $OUT.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/share-out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
for b in ${B_SHAPES:-2048x8192 8192x2048}; do
  # shellcheck disable=SC2086
  timeout "${SHARE_TIMEOUT:-240}" python scripts/gemv_share.py --b-shape "$b" ${SHARE_ARGS:-} --json "$OUT/share-$b.json"
done
