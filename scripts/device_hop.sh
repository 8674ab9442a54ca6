#!/bin/bash
# One device call: the runtime GPU tests, then the hop figures (runtime_hop.py) into $OUT/hop.json.
# Optional: MLP=1 also runs `bench runtime --only mlp --quick` (the waits=True MLP tasks still work).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee $OUT/env.txt
timeout ${TEST_S:-150} python -m pytest -q -p no:cacheprovider tests/test_runtime_gpu.py 2>&1 | tee $OUT/pytest.log | tail -8
timeout ${HOP_S:-120} python -m warploop.bench.runtime_hop ${HOPS:-2000} > $OUT/hop.json 2> $OUT/hop.err
echo "hop rc=$?"
tail -c 1500 $OUT/hop.err
python - <<'PY'
import json, os
d = json.load(open(os.path.join(os.environ["OUT"], "hop.json")))
print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items() if not isinstance(v, (dict, list))})
PY
if [ "${MLP:-0}" = 1 ]; then
  timeout ${MLP_S:-150} python -m warploop.cli bench runtime --only mlp --quick --json > $OUT/mlp.json 2> $OUT/mlp.err
  echo "mlp rc=$?"
  tail -c 2500 $OUT/mlp.err
fi
nvidia-smi --query-gpu=clocks.sm --format=csv
