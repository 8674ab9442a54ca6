"""`warploop bench runtime`: the resident runtime against kernel launches and CUDA graphs.

1. Dependent hops: a chain of N tiny steps (x[i] = x[i-1] + 1). As a static graph whose nodes
   are pinned round-robin on the workers (every hop crosses workers), timed on the GPU's global
   timer by the front; as a CUDA graph of N Triton kernels; as N Triton launches from Python.
2. Throughput: independent tiny tasks spawned on the GPU through the dynamic queue (and, for
   scale, as one static graph).
3. Host submit -> result round trip of a no-op task: p50 and p99.
4. The MLP stack: 16 layers of [GEMV 2048->8192 + SiLU, GEMV 8192->2048], bf16, batch 1, as one
   static graph (the fastest correct of a few tile schedules, runtime_mlp_tasks.MLP_SCHEDULES) vs a
   CUDA graph of the same per-op Triton kernels (the best of a few tile configs, each timed in a
   CUDA graph) vs torch eager; each against the floor, weight bytes over the measured
   device-to-device copy rate. SM clocks are sampled during each section.

Peers run before any runtime opens (the resident kernel holds SMs until close). Without a GPU the
CPU executor's figures are reported and the GPU-only keys are null.
"""
from __future__ import annotations

import argparse
import time

import warploop
from warploop.args import positive_int
from warploop.bench.common import emit, header
from warploop.bench.runtime_gpu import gpu_figures
from warploop.bench.runtime_kernels import HOP_TASKS, hop, noop, spawn_tree
from warploop.bench.timing import submit_latency


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", default=None, help="also write the JSON to this file")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--layers", type=positive_int, default=16, help="MLP layers (default 16)")
    parser.add_argument("--only", choices=("hops", "mlp"), default=None,
                        help="GPU: run only the hop/throughput/submit part or only the MLP stack")


def hop_graph(rt, x, n: int):
    g = rt.graph()
    prev = []
    for i in range(n):
        prev = [g.add(hop, x, i, after=prev, worker=i % rt.workers)]
    return g


def cpu_figures(quick: bool) -> dict:
    import torch

    n = 24 if quick else 64
    with warploop.Runtime(device="cpu", tasks=HOP_TASKS, workers=4) as rt:
        x = torch.zeros(n, dtype=torch.int32)
        g = hop_graph(rt, x, n)
        g.run()
        t0 = time.perf_counter()
        g.run()
        hop_us = (time.perf_counter() - t0) * 1e6 / n
        counter = torch.zeros(1, dtype=torch.int32)
        t0 = time.perf_counter()
        rt.submit(spawn_tree, counter, 4, n // 4).result()
        tasks_per_s = (n + 5) / (time.perf_counter() - t0)
        p50, p99, host_us = submit_latency(rt, noop, (), 20 if quick else 100)
        ok = int(x[-1]) == 2 + n - 1 and int(counter) == 4 * (n // 4)
    return {"executor": "cpu (Triton interpreter)", "ok": ok, "dependent_hop_us": hop_us,
            "cuda_graph_node_us": None, "triton_launch_us": None, "tasks_per_s": tasks_per_s,
            "submit_p50_us": p50, "submit_p99_us": p99, "submit_host_p50_us": host_us,
            "cross_worker_hop_us": None,
            "mlp_stack": {"warploop_us": None, "cuda_graph_us": None, "torch_eager_us": None, "floor_us": None},
            "coexist": {k: None for k in ("matmul_alone_tflops", "matmul_beside_tflops", "copy_alone_gbps",
                                          "copy_beside_gbps", "fanout_tasks_per_s")}}


def main(args: argparse.Namespace) -> int:
    data = header("runtime")
    if data["target"] == "cpu":
        data.update(cpu_figures(args.quick))
    else:
        data.update(gpu_figures(quick=args.quick, layers=args.layers, only=args.only))
    if args.json:
        emit(data, args.out)
    else:
        for key, value in data.items():
            print(f"{key}: {value}")
    return 0
