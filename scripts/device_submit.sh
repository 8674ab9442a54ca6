#!/usr/bin/env bash
# Device check behind the submit-path figures (warploop/bench/runtime_submit.py):
#   scripts/device_submit.sh LABEL [tests]
# On this copy of the tree only, worker.py passes BACKEND to try_pop/complete so the worker
# stages are stamped too (the owner of worker.py is asked to make that change for real).
# Writes $OUT/submit-LABEL.json; with "tests", also runs the runtime and std GPU tests.
set -uo pipefail
label=${1:-run}
export PYTHONPATH=. PYTHONUNBUFFERED=1
sed -i 's/^\(\s*\)complete(arena, tid, status)$/\1complete(arena, tid, status, BACKEND)/;
        s/tid = try_pop(arena)$/tid = try_pop(arena, BACKEND)/' warploop/runtime/worker.py
grep -n "try_pop(\|complete(arena, tid" warploop/runtime/worker.py
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
python - "$label" <<'PY'
import json, os, sys, time
import torch
import warploop
from warploop.bench.runtime import submit_latency
from warploop.bench.runtime_kernels import HOP_TASKS, noop
from warploop.bench.runtime_submit import submit_breakdown
label = sys.argv[1]
sms = torch.cuda.get_device_properties(0).multi_processor_count
out = {"label": label, "device": torch.cuda.get_device_name(0)}
# The bench's configuration (runtime_gpu.runtime_hops): one 1-warp worker per SM.
for name, kw in (("1warp", dict(workers=sms, worker_warps=1, pool=1 << 18)), ("default", {})):
    t0 = time.perf_counter()
    with warploop.Runtime(device="cuda", tasks=HOP_TASKS, **kw) as rt:
        p50, p99, host = submit_latency(rt, noop, (), 2000)
        bd = submit_breakdown(rt, 2000)
        p50b, p99b, hostb = submit_latency(rt, noop, (), 2000)
        out[name] = {"workers": rt.workers, "submit_p50_us": [p50, p50b], "submit_p99_us": [p99, p99b],
                     "submit_host_p50_us": [host, hostb], "breakdown": bd}
    print(name, f"{time.perf_counter() - t0:.1f}s", json.dumps(out[name], indent=1), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), f"submit-{label}.json"), "w"), indent=1)
PY
if [ "${2:-}" = tests ]; then
  python -m pytest -q -x tests/test_runtime_gpu.py tests/test_std_gpu.py tests/test_runtime_submit.py 2>&1 | tail -15
fi
