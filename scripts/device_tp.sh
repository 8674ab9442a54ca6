#!/bin/bash
# Issue 13 on a two-GPU machine (nvidia-h200-x2 or nvidia-h100-x2), everything in one device call:
#   tests    the NCCL tests (tests/test_tp_gpu.py, with the sharding tests) > $OUT/pytest.log
#   user     `warploop generate --tensor-parallel 2` on tiny in fresh processes, greedy, against TP=1,
#            with each all-reduce (WARPLOOP_TP_ALLREDUCE nccl, symm)
#   one|tp|tp_symm|tp_eager|compile|replicas   scripts/bench_tp.py --part P > $OUT/tp-P.json
# Each part runs in its own process under its own time limit, all under one deadline (DEADLINE_S),
# so a part that hangs costs only its own figures; on its limit a part gets SIGABRT first, which
# (PYTHONFAULTHANDLER) prints every thread's stack. Logs go to $OUT/parts.log (the device tool
# brings back only a few files). PARTS (default below); tp_eager runs too when tp left no figures.
# The first bench part writes the random Llama-3.1-8B checkpoint to /tmp (about 16 GB, ~20 s);
# later parts and later calls on the same warm machine reuse it. NVLink multicast stays off.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONFAULTHANDLER=1
PARTS=${PARTS:-tests tp tp_symm one user replicas compile}
START=$(date +%s)
DEADLINE_S=${DEADLINE_S:-570}
LOG=$OUT/parts.log
left() { echo $(( DEADLINE_S - ($(date +%s) - START) )); }
{ nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
} 2>&1 | tee -a $LOG
run_part() {
  local part=$1 limit=$2
  local l=$(left)
  [ "$limit" -gt "$l" ] && limit=$l
  if [ "$limit" -lt 30 ]; then echo "part $part skipped: ${l}s left" | tee -a $LOG; return; fi
  local t0=$(date +%s)
  echo "=== $part (limit ${limit}s)" >> $LOG
  case $part in
    tests)
      timeout -s ABRT -k 10 $limit python -m pytest -q -p no:cacheprovider -rf --tb=short --timeout=120 \
        tests/test_tp_gpu.py tests/test_tp_shard.py > $OUT/pytest.log 2>&1
      echo "tests rc=$? in $(( $(date +%s) - t0 ))s"; tail -25 $OUT/pytest.log ;;
    user)
      timeout -s ABRT -k 10 $limit bash -c '
        for run in 1:auto 2:nccl 2:symm; do
          echo "tensor-parallel ${run%%:*}, WARPLOOP_TP_ALLREDUCE=${run##*:}"
          WARPLOOP_TP_ALLREDUCE=${run##*:} python -m warploop.cli generate --model tiny --device cuda \
            --prompt "def add(a, b):" --max-tokens 64 --temperature 0 --tensor-parallel ${run%%:*} --json
        done' > $OUT/user.log 2>&1
      echo "user rc=$? in $(( $(date +%s) - t0 ))s"; cat $OUT/user.log ;;
    *)
      timeout -s ABRT -k 10 $limit python scripts/bench_tp.py --part $part > $OUT/tp-$part.json 2>> $LOG
      echo "bench $part rc=$? in $(( $(date +%s) - t0 ))s"; cat $OUT/tp-$part.json; echo ;;
  esac 2>&1 | tee -a $LOG
}
for part in $PARTS; do
  case $part in
    tests) run_part tests 200 ;;
    compile) run_part compile 300 ;;
    *) run_part $part 150 ;;
  esac
  if [ "$part" = tp ] && ! grep -q ms_per_token_bs1 $OUT/tp-tp.json 2>/dev/null; then run_part tp_eager 120; fi
done
