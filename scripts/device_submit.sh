#!/usr/bin/env bash
# Device check behind the submit-path figures (warploop/bench/runtime_submit.py):
#   scripts/device_submit.sh LABEL [BASE_TREE] [tests]
# Measures the tree's warploop, then the one under BASE_TREE (a copy of the package from before a
# change, carried along: `git archive REV warploop | tar -x -C .submit_base`) when given.
# Writes $OUT/submit-LABEL.json (and -base); with "tests", also runs the runtime and std GPU tests.
# Each part runs under a kill timeout and dumps its Python stack if it stalls.
set -uo pipefail
label=${1:-run}
base=${2:-}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
measure() (
cd "$1" && timeout -s KILL "$3" python - "$2" <<'PY'
import faulthandler, json, os, sys, time
faulthandler.dump_traceback_later(int(os.environ.get("WL_DUMP_S", "60")), exit=False)
import torch
import warploop
print("warploop from", warploop.__file__, flush=True)
from warploop.bench.runtime import submit_latency
from warploop.bench.runtime_kernels import HOP_TASKS, noop
from warploop.bench.runtime_submit import bus_floor, submit_breakdown
label = sys.argv[1]
sms = torch.cuda.get_device_properties(0).multi_processor_count
out = {"label": label, "device": torch.cuda.get_device_name(0)}
floor = bus_floor() if not label.endswith("-base") else None    # before any runtime opens
print("bus floor", json.dumps(floor), flush=True)
# The bench's configuration (runtime_gpu.runtime_hops): one 1-warp worker per SM.
for name, kw in (("1warp", dict(workers=sms, worker_warps=1, pool=1 << 18)), ("default", {})):
    t0 = time.perf_counter()
    if name == "default" and label.endswith("-base"):
        continue
    with warploop.Runtime(device="cuda", tasks=HOP_TASKS, **kw) as rt:
        print(name, f"started in {time.perf_counter() - t0:.1f}s", flush=True)
        p50, p99, host = submit_latency(rt, noop, (), 2000)
        print(name, "p50", p50, "p99", p99, flush=True)
        bd = submit_breakdown(rt, 1000, floor=floor)
        print(name, "breakdown", json.dumps(bd), flush=True)
        p50b, p99b, hostb = submit_latency(rt, noop, (), 2000)
        out[name] = {"workers": rt.workers, "submit_p50_us": [p50, p50b], "submit_p99_us": [p99, p99b],
                     "submit_host_p50_us": [host, hostb], "breakdown": bd}
    print(name, f"{time.perf_counter() - t0:.1f}s", json.dumps(out[name], indent=1), flush=True)
    json.dump(out, open(os.path.join(os.environ["OUT"], f"submit-{label}.json"), "w"), indent=1)
PY
)
measure . "$label" 80
[ -n "$base" ] && WL_DUMP_S=40 measure "$base" "$label-base" 60
if [ "${3:-}" = tests ]; then
  PYTHONPATH=. timeout -s KILL 100 python -m pytest -q -x tests/test_runtime_gpu.py tests/test_std_gpu.py tests/test_runtime_submit.py 2>&1 | tail -15
fi
