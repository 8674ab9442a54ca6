#!/usr/bin/env bash
# Two source trees' megakernels timed in turn on the GPU machine: the committed tree at .carry/old
# (git archive REV warploop scripts | tar -x -C .carry/old) against the working tree, each from the
# carried Triton cache (a tree whose kernel is not in it is skipped, not compiled here), alternating
# AB_ROUNDS times per model of $AB_MODELS; JSON into $OUT/{old,new}-MODEL-ROUND.json.
set -uo pipefail
OUT="${OUT:-/tmp/ab-out}"; mkdir -p "$OUT"
export TRITON_CACHE_DIR=/tmp/wl-triton-cache WARPLOOP_PORTABLE_CACHE=1
mkdir -p "$TRITON_CACHE_DIR"; tar xzf .carry/triton-cache.tgz -C "$TRITON_CACHE_DIR"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
root=$PWD
for model in ${AB_MODELS//,/ }; do
  for r in $(seq "${AB_ROUNDS:-2}"); do
    for t in old new; do
      d=$root; [ "$t" = old ] && d=$root/.carry/old
      (cd "$d" && export PYTHONPATH=$d &&
       if timeout 30 python scripts/mk_probe.py --model "$model" --compile-only --plan "${AB_PLAN:-{\}}" > /dev/null; then
         python scripts/mk_probe.py --model "$model" --plan "${AB_PLAN:-{\}}" --batch ${AB_BATCHES:-1 8 32} \
           --context "${AB_CONTEXT:-512}" --repeat 10 > "$OUT/$t-$model-$r.json"
         echo "$t $model $r: $(grep -o '"\(p[0-9]*_\)\?bs[0-9]*": [0-9.]*' "$OUT/$t-$model-$r.json" | tr '\n' ' ')"
       else echo "$t $model: not in the cache, skipped"; fi)
    done
  done
done
