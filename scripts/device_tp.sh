#!/bin/bash
# Issue 13 on nvidia-h200-x2, one part per device call (each well under the 10-minute limit):
#   PART=tests     the NCCL tests (tests/test_tp_gpu.py) and the TP/replica CPU tests
#   PART=one|tp|tp_eager|compile|replicas   scripts/bench_tp.py --part $PART > $OUT/tp-$PART.json
# The first bench part writes the random Llama-3.1-8B checkpoint to /tmp (about 16 GB, a minute);
# later parts in the same warm machine reuse it. NVLink multicast stays off.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
PART=${PART:-tests}
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv 2>&1 | tee $OUT/env.txt
if [ "$PART" = tests ]; then
  timeout ${TEST_S:-300} python -m pytest -q -p no:cacheprovider tests/test_tp_gpu.py tests/test_tp_shard.py \
    2>&1 | tee $OUT/pytest.log | tail -15
else
  timeout ${BENCH_S:-540} python scripts/bench_tp.py --part $PART > $OUT/tp-$PART.json 2> $OUT/tp-$PART.err
  echo "bench $PART rc=$?"
  tail -c 2500 $OUT/tp-$PART.err
  cat $OUT/tp-$PART.json
fi
