"""Compile the decode megakernel's resident kernel for a GPU on this machine, which needs none,
into Triton's cache, and pack the cache for the GPU machine (the device tool carries .carry/).

    PYTHONPATH=$PWD python scripts/mk_cache.py --model llama-3.2-1b --plan '{"tile_kb":64}' --trace both
    # then, on the GPU machine: WARPLOOP_PORTABLE_CACHE=1 TRITON_CACHE_DIR=... (scripts/device_mk.sh)

Each (model, plan, traced) is compiled in its own process, as the GPU's process would compile it
(Triton's JIT warmup, with a stand-in driver that names the target): the same source, options and
target give the same cache key there, with WARPLOOP_PORTABLE_CACHE=1 on both sides
(warploop/runtime/portable_cache.py). A kernel already in the cache is not compiled again.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import io
import json
import os
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# The models the GPU tests start megakernels for (with the default plan, every batch on the graph):
# tests/test_mk_gpu.py and test_mk_diff.py (block size 4), and the server test (the tiny model in float32).
GPU_TEST_MODELS = ("test:LLAMA_GQA:float32:4", "test:QWEN3_LIKE:float32:4", "test:LLAMA_GQA:bfloat16:4",
                   "tiny:float32")


def plans_of(cfg, overrides: dict, dtype=None, block_size: int = 16):
    """([the Plan of each resident kernel a GPU backend starts], worker warps, register cap) for a
    model's shapes and WARPLOOP_MK_PLAN-style overrides: the batch-1 kernel's first, then the batches'
    where they differ (plans.kernel_plans; '{"batch1_kernel": 0}' is one kernel for every batch).
    Other backend-only options such as workers are dropped: they do not change the kernel. With
    graph_rows 1 named (the GPU backend's default: batches run per op) the batches' kernel is left out,
    as such a backend starts none; unnamed, both are compiled."""
    import torch

    from warploop.llm.mk.plans import MegakernelOptions, kernel_plans
    options = MegakernelOptions.of(overrides)
    first, many, two = kernel_plans(cfg, dtype or torch.bfloat16, block_size, "cuda", options)
    return ([first, many] if two and options.graph_rows != 1 else [first]), options.worker_warps, options.max_registers


class StandInDriver:
    """What Triton's JIT asks of a driver to compile (not launch) for `target`."""

    def __init__(self, target) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


def compile_kernel(plan, warps: int, trace: bool = False, arch: int = 90, max_registers: int | None = None):
    """The plan's resident kernel, compiled as the runtime compiles it (Triton's JIT warmup, into
    Triton's cache, nothing launched), for sm_`arch` through a stand-in driver, so the same source,
    options and target give the key a GPU machine looks up (with WARPLOOP_PORTABLE_CACHE)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    from warploop.llm.mk.tasks import tasks_for
    from warploop.runtime import codegen
    from warploop.runtime.gpu import compile_resident
    from warploop.runtime.tasks import lookup
    module = codegen.build([lookup(t) for t in tasks_for(plan).all])
    saved = driver._active      # noqa: SLF001 (reset_active would look for a real driver)
    driver.set_active(StandInDriver(GPUTarget("cuda", arch, 32)))
    try:
        return compile_resident(module, torch.device("cpu"), "cuda", warps, trace, max_registers)[0]
    finally:
        driver._active = saved  # noqa: SLF001


def compile_one(model: str, plan: str, traced: bool, arch: int) -> dict:
    """In this process: the resident kernels of `model` under `plan` for sm_`arch` (every kernel a
    backend with that plan starts: the batch-1 kernel and the batches', plans_of)."""
    os.environ["WARPLOOP_PORTABLE_CACHE"] = "1"
    from warploop.llm.shapes import CPU_MODELS, GPU_MODELS

    if model.startswith("test:"):   # a GPU test's model: test:CONFIG:DTYPE:BLOCK (tests/mk_helpers.py)
        import torch
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
        import mk_helpers
        _, name, dtype, block = model.split(":")
        plans, warps, regs = plans_of(getattr(mk_helpers, name), json.loads(plan), getattr(torch, dtype),
                                      int(block))
    elif model.startswith("tiny"):  # the embedded model, in its own dtype (what `warploop generate` runs)
        import torch

        from warploop.llm.build import torch_dtype
        from warploop.llm.loader import load_config, resolve_model_dir
        cfg = load_config(resolve_model_dir("tiny"))
        dtype = getattr(torch, model.split(":")[1]) if ":" in model else torch_dtype(None, cfg)   # tiny:float32
        plans, warps, regs = plans_of(cfg, json.loads(plan), dtype)
    else:
        cfg = (GPU_MODELS | CPU_MODELS)[model][1]
        plans, warps, regs = plans_of(cfg, json.loads(plan))
    out = {"model": model, "plan": plan, "trace": traced, "kernels": []}
    for p in plans:
        t0 = time.perf_counter()
        kernel = compile_kernel(p, warps, traced, arch, regs)
        out["kernels"].append({"key": p.key, "s": round(time.perf_counter() - t0, 1),
                               "shared": kernel.metadata.shared, "hash": kernel.hash})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", default=["llama-3.2-1b"],
                        help="bench model shapes (warploop bench decode's names), tiny (the embedded model; "
                             "tiny:float32 in another dtype), or a GPU test's model, test:CONFIG:DTYPE:BLOCK "
                             "(tests/mk_helpers.py; --gpu-tests: all of them)")
    parser.add_argument("--gpu-tests", action="store_true",
                        help="add the kernels tests/test_mk_gpu.py, test_mk_diff.py and test_server_gpu.py start")
    parser.add_argument("--plan", nargs="+", default=["{}"],
                        help="WARPLOOP_MK_PLAN-style JSON objects, one kernel each")
    parser.add_argument("--trace", choices=("off", "on", "both"), default="off")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (H100/H200: 90)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--pack", default=".carry/triton-cache.tgz", help="the cache packed here ('' : not packed)")
    parser.add_argument("--unpack-dir", default="/tmp/wl-triton-cache",
                        help="where the GPU machine unpacks it (its TRITON_CACHE_DIR; scripts/device_mk.sh's): "
                             "Triton's group files name their members by absolute path")
    parser.add_argument("--one", help=argparse.SUPPRESS)   # internal: compile one JSON job in this process
    args = parser.parse_args()
    if args.one:
        job = json.loads(args.one)
        print(json.dumps(compile_one(job["model"], job["plan"], job["trace"], job["arch"])), flush=True)
        return
    cache = os.environ.get("TRITON_CACHE_DIR")
    if not cache:
        parser.error("set TRITON_CACHE_DIR: the cache to fill (and pack)")
    if args.gpu_tests:
        args.model = list(dict.fromkeys(args.model + list(GPU_TEST_MODELS)))
    traces = {"off": [False], "on": [True], "both": [False, True]}[args.trace]
    jobs = [{"model": m, "plan": p, "trace": t, "arch": args.arch} for m in args.model for p in args.plan
            for t in traces]

    def run(job):
        r = subprocess.run([sys.executable, __file__, "--one", json.dumps(job)], capture_output=True, text=True)
        if r.returncode:
            return {**job, "error": r.stderr.strip().splitlines()[-1:] or [f"exit {r.returncode}"]}
        return json.loads(r.stdout.strip().splitlines()[-1])

    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for row in pool.map(run, jobs):
            print(json.dumps(row), flush=True)
    if args.pack:
        os.makedirs(os.path.dirname(args.pack) or ".", exist_ok=True)
        pack(cache, args.pack, args.unpack_dir)
        print(json.dumps({"packed": args.pack, "bytes": os.path.getsize(args.pack)}))


def pack(cache: str, path: str, unpack_dir: str) -> None:
    """Tar `cache` into `path`, each group file's member paths rewritten from `cache` to
    `unpack_dir` (Triton drops a group member whose path does not exist: a cache miss there)."""
    src = os.path.abspath(cache).rstrip("/") + "/"
    dst = unpack_dir.rstrip("/") + "/"
    with tarfile.open(path, "w:gz") as tar:
        for root, _, files in os.walk(cache):
            for name in sorted(files):
                full = os.path.join(root, name)
                arc = os.path.relpath(full, cache)
                if not name.startswith("__grp__"):
                    tar.add(full, arcname=arc)
                    continue
                with open(full) as f:
                    data = f.read().replace(src, dst).encode()
                info = tarfile.TarInfo(arc)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


if __name__ == "__main__":
    main()
