#!/bin/bash
# One device call: the std continuation path (issue 4) and the runtime GPU tests, then bench hostcall.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee $OUT/env.txt
timeout 300 python -m pytest -q -p no:cacheprovider tests/test_std_then.py tests/test_std_runtime.py tests/test_std_gpu.py tests/test_runtime_gpu.py 2>&1 | tee $OUT/pytest.log | tail -25
timeout 200 python -m warploop.cli bench hostcall --json > $OUT/hostcall.json 2> $OUT/hostcall.err
echo "bench rc=$?"
tail -c 1500 $OUT/hostcall.err
python -c "import json,sys; d=json.load(open('$OUT/hostcall.json')); print({k: v for k, v in d.items() if k not in ('versions',)})"
nvidia-smi --query-gpu=clocks.sm --format=csv
