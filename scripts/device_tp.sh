#!/bin/bash
# Issue 13 on a two-GPU machine (nvidia-h200-x2 or nvidia-h100-x2), everything in one device call:
#   the NCCL tests (tests/test_tp_gpu.py, with the sharding tests), then each bench part of
#   scripts/bench_tp.py in its own process, > $OUT/tp-<part>.json, each under its own time limit and
#   all under one deadline (DEADLINE_S), so a part that hangs costs only its own figures.
#   PARTS (default "tests one tp replicas compile"); tp_eager runs too when tp left no figures.
# The first bench part writes the random Llama-3.1-8B checkpoint to /tmp (about 16 GB); later parts
# and later calls on the same warm machine reuse it. NVLink multicast stays off.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
PARTS=${PARTS:-tests one tp replicas compile}
START=$(date +%s)
DEADLINE_S=${DEADLINE_S:-570}
left() { echo $(( DEADLINE_S - ($(date +%s) - START) )); }
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv 2>&1 | tee $OUT/env.txt
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())" | tee -a $OUT/env.txt
run_part() {
  local part=$1 limit=$2
  local l=$(left)
  [ "$limit" -gt "$l" ] && limit=$l
  if [ "$limit" -lt 30 ]; then echo "part $part skipped: ${l}s left"; return; fi
  local t0=$(date +%s)
  if [ "$part" = tests ]; then
    timeout $limit python -m pytest -q -p no:cacheprovider tests/test_tp_gpu.py tests/test_tp_shard.py \
      > $OUT/pytest.log 2>&1
    echo "tests rc=$? in $(( $(date +%s) - t0 ))s"; tail -15 $OUT/pytest.log
  else
    timeout $limit python scripts/bench_tp.py --part $part > $OUT/tp-$part.json 2> $OUT/tp-$part.err
    echo "bench $part rc=$? in $(( $(date +%s) - t0 ))s"; tail -c 1500 $OUT/tp-$part.err; cat $OUT/tp-$part.json; echo
  fi
}
for part in $PARTS; do
  case $part in
    tests) run_part tests 150 ;;
    compile) run_part compile 300 ;;
    *) run_part $part 200 ;;
  esac
  if [ "$part" = tp ] && ! grep -q ms_per_token_bs1 $OUT/tp-tp.json 2>/dev/null; then run_part tp_eager 150; fi
done
