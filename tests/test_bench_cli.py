"""`warploop bench runtime|hostcall --json` run without a GPU and print their contract keys."""
import json
import os
import subprocess
import sys

import pytest

CONTRACT = {
    "runtime": {"dependent_hop_us", "cuda_graph_node_us", "triton_launch_us", "tasks_per_s",
                "submit_p50_us", "submit_p99_us", "mlp_stack", "cross_worker_hop_us", "coexist"},
    "hostcall": {"call_p50_us", "call_p99_us", "calls_per_s", "print_lines_per_s", "print_lost",
                 "file_read_gbps", "plain_read_gbps"},
}


@pytest.mark.parametrize("bench", sorted(CONTRACT))
def test_bench_runs_on_the_cpu_with_contract_keys(bench):
    env = {**os.environ, "WARPLOOP_DEVICE": "cpu"}
    # runtime: --quick, the smoke run's sizes (24 dependent hops, not 64; 20 submits timed, not 100):
    # the same figures and keys in half the time
    quick = ["--quick"] if bench == "runtime" else []
    out = subprocess.run([sys.executable, "-m", "warploop.cli", "bench", bench, "--json", *quick],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    assert CONTRACT[bench] <= set(data)
    assert {"device", "date", "versions"} <= set(data)
    assert data["device"] == "cpu"
    if bench == "runtime":
        assert set(data["mlp_stack"]) == {"warploop_us", "cuda_graph_us", "torch_eager_us", "floor_us"}
        assert data["cuda_graph_node_us"] is None          # GPU-only keys are null on the CPU
        assert {"matmul_alone_tflops", "matmul_beside_tflops", "copy_alone_gbps", "copy_beside_gbps",
                "fanout_tasks_per_s"} <= set(data["coexist"])
        assert data["dependent_hop_us"] > 0 and data["tasks_per_s"] > 0
    else:
        assert data["print_lost"] == 0
        assert data["call_p50_us"] > 0 and data["calls_per_s"] > 0
