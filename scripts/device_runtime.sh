#!/bin/bash
# One device call: environment, the runtime's GPU tests, then `warploop bench runtime --json`.
#   TEST_S=150 BENCH_S=300 bash scripts/device_runtime.sh        (on the device, from the repo root)
# Results land in $OUT: env.txt, pytest.log, runtime-<device>-<date>.json, bench.log.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
set -o pipefail
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,persistence_mode --format=csv 2>&1 | tee $OUT/env.txt
python -c "import torch, triton, importlib.metadata as m; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda-bindings', m.version('cuda-bindings'))" 2>&1 | tee -a $OUT/env.txt
SLUG=$(python -c "from warploop.bench.common import device_slug; print(device_slug())")
DAY=$(date -u +%Y%m%d)
timeout ${TEST_S:-150} python -m pytest -q -p no:cacheprovider tests/test_runtime_gpu.py tests/test_std_gpu.py 2>&1 | tee $OUT/pytest.log | tail -4
timeout ${BENCH_S:-300} python -m warploop.cli bench runtime --json --out $OUT/runtime-$SLUG-$DAY.json > $OUT/bench.log 2>&1
echo "bench rc=$?"
grep '^\[bench runtime\]' $OUT/bench.log | cut -c1-400
python - <<'PY'
import glob, json, os
for f in glob.glob(os.environ["OUT"] + "/runtime-*.json"):
    d = json.load(open(f))
    keys = ("dependent_hop_us", "cross_worker_hop_us", "cuda_graph_node_us", "triton_launch_us", "tasks_per_s",
            "submit_p50_us", "submit_p99_us", "submit_host_p50_us")
    print({k: d.get(k) for k in keys})
    m = d["mlp_stack"]
    print({k: m.get(k) for k in ("warploop_us", "cuda_graph_us", "torch_eager_us", "floor_us", "warploop_pct_of_floor",
                                 "cuda_graph_pct_of_floor", "speedup_vs_cuda_graph", "variant",
                                 "no_dependencies_diagnostic_us", "rel_err_vs_fp32")})
PY
