"""`warploop bench bundle`: bundles vs Triton's JIT on correctness, cold start and launch overhead.

1. Correctness: every kernel of warploop/bench/kernels.py, loaded from the bundle in fresh processes where
   `import triton` fails (and, on a GPU, in one where `import torch` fails too, with DeviceArrays),
   against float64 numpy references with fresh inputs and NaN-poisoned outputs (bundle_child.py).
2. Cold start: a fresh process to the first correct result of every kernel, three ways, alternated:
   the bundle with only warploop, cuda.bindings and numpy imported (`cold_start_s`); the bundle with
   torch (`cold_start_torch_s`); Triton JIT with torch and an empty TRITON_CACHE_DIR. Each child also
   reports how much of its time went to kernels (load/compile + first launches + checks).
3. Launch overhead (GPU): host time per `add[grid](x, y, out, n)` issue, warploop (torch tensors, and
   DeviceArrays) vs Triton's launcher vs a raw cuLaunchKernel with pre-packed arguments (the floor),
   interleaved rounds, medians; plus the launcher's Python work and a per-call breakdown of its parts.
On a machine without a GPU it runs 1 and 2 on the CPU executor and leaves the GPU-only keys null.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_SOURCE = Path(__file__).resolve().with_name("kernels.py")  # shipped in the package (examples/ links to it)


# The least a fresh CUDA process with numpy pays before any kernel: interpreter, numpy, cuda.bindings,
# cuInit and the primary context. The torch-free bundle process cannot start faster than this.
FLOOR = ("import numpy; from cuda.bindings import driver as cu; cu.cuInit(0); _, d = cu.cuDeviceGet(0); "
         "_, c = cu.cuDevicePrimaryCtxRetain(d); assert cu.cuCtxSetCurrent(c)[0] == 0")


def timed_process(cmd: list[str], env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=600)
    return proc, time.perf_counter() - t0


def run_child(kind: str, path: str, device: str | None, env: dict | None = None) -> dict:
    """One fresh process of bundle_child.py, timed from start to exit."""
    cmd = [sys.executable, "-m", "warploop.bench.bundle_child", kind, path] + (["--device", device] if device else [])
    proc, wall = timed_process(cmd, env)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} child failed:\n{proc.stderr[-4000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "wall_s": wall}


def launch_overhead(bundle_path: str, source: Path, reps: int = 500, rounds: int = 15) -> dict:
    """Host µs per launch of `add` (3 pointers + an int): warploop with torch tensors and with
    DeviceArrays, Triton, raw cuLaunchKernel; and the launcher's Python work with the driver call taken out."""
    import ctypes

    import numpy as np
    import torch
    from cuda.bindings import driver as cu

    import warploop
    from warploop.bundle.build import import_source
    from warploop.driver import empty, from_numpy
    from warploop.driver.null import NullDriver

    n = 1024
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    out = torch.empty(n, device="cuda")
    xa, ya, outa = from_numpy(x.cpu().numpy()), from_numpy(y.cpu().numpy()), empty(n)
    expected, nan = (x + y).cpu().numpy(), np.full(n, np.nan, np.float32)
    wk = warploop.load_bundle(bundle_path).add
    tk = import_source(source).add
    spec = next(s for s in wk.specs if s.spec.specialize)  # the aligned variant the fast path picks here
    slots = (ctypes.c_uint64 * 6)(x.data_ptr(), y.data_ptr(), out.data_ptr(), n, 0, 0)
    ptrs = (ctypes.c_void_p * 6)(*[ctypes.addressof(slots) + 8 * i for i in range(6)])
    raw_args = (spec.handle, 1, 1, 1, spec.block, 1, 1, spec.variant.shared, None, ctypes.addressof(ptrs), 0)
    grid = (1,)
    # The launcher's own Python work: the same fast path with the driver call replaced by a no-op.
    null = NullDriver(wk.specs[0].driver.info, record=False, torch_streams=True)
    nk = warploop.load_bundle(bundle_path, driver=null).add
    noop = null.launch_api(1, False, False)
    na, nb, nout = (empty(n, driver=null) for _ in range(3))

    # Each loop is written out as user code is: `k[grid](x, y, out, n)`, indexing by the grid every time.
    def run_warploop():
        for _ in range(reps):
            wk[grid](x, y, out, n)

    def run_warploop_array():
        for _ in range(reps):
            wk[grid](xa, ya, outa, n)

    def run_triton():
        for _ in range(reps):
            tk[grid](x, y, out, n, BLOCK=1024)

    def run_raw():
        for _ in range(reps):
            launch(*raw_args)

    def run_null():
        for _ in range(reps):
            nk[grid](x, y, out, n)

    def run_null_array():
        for _ in range(reps):
            nk[grid](na, nb, nout, n)

    def run_noop():
        for _ in range(reps):
            noop(*raw_args)

    launch = cu.cuLaunchKernel
    methods = {"warploop": run_warploop, "warploop_array": run_warploop_array, "triton": run_triton, "raw": run_raw,
               "null": run_null, "null_array": run_null_array, "noop": run_noop}
    try:  # for scale: the same driver call through ctypes, without cuda.bindings' argument handling
        c_launch = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
        c_launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        c_launch.restype = ctypes.c_int
        c_args = (int(spec.handle), 1, 1, 1, spec.block, 1, 1, spec.variant.shared, None, ctypes.addressof(ptrs), None)

        def run_ctypes():
            for _ in range(reps):
                c_launch(*c_args)

        methods["raw_ctypes"] = run_ctypes
    except (OSError, AttributeError, TypeError):
        pass
    samples: dict[str, list[float]] = {k: [] for k in methods}
    correct = {}
    for r in range(rounds + 1):
        for name, fn in methods.items():
            out.fill_(float("nan"))
            outa.copy_from_numpy(nan)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            if name == "warploop_array":
                correct[name] = bool(np.array_equal(outa.to_numpy(), expected))
            elif not name.startswith(("null", "noop")):
                correct[name] = bool(torch.equal(out, x + y))
            if r:  # round 0 warms up (Triton compiles here)
                samples[name].append((t1 - t0) / reps * 1e6)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {"warploop": med["warploop"], "warploop_array": med["warploop_array"], "triton": med["triton"],
            "raw": med["raw"], "python_work_us": med["null"] - med["noop"],
            "python_work_array_us": med["null_array"] - med["noop"], "raw_ctypes_us": med.get("raw_ctypes"),
            "correct": correct, "spread_us": {k: max(v) - min(v) for k, v in samples.items()},
            "python_parts_ns": python_parts(x, spec), "reps": reps, "rounds": rounds}


def python_parts(x, spec) -> dict[str, float]:
    """ns per call of each piece of the fast path's work, on this host, for the breakdown in BENCHMARKS.md."""
    import threading
    import timeit

    import torch

    missing = object()

    def signature(a0=missing, a1=missing, a2=missing, a3=missing, *extra, stream=None, **meta):
        return None

    def plain(a0, a1, a2, a3):
        return None

    names = {"x": x, "signature": signature, "plain": plain, "ident": threading.get_ident, "pack": spec.pack_into,
             "buf": spec.buffer, "stream": getattr(torch._C, "_cuda_getCurrentRawStream", int), "f32": torch.float32}
    parts = {"call, launcher signature": "signature(x, x, x, 4)", "call, plain signature": "plain(x, x, x, 4)",
             "data_ptr()": "x.data_ptr()", "get_device()": "x.get_device()", "dtype is": "x.dtype is f32",
             "thread id": "ident()", "pack_into, 4 slots": "pack(buf, 0, 1, 2, 3, 4)",
             "current stream": "stream(0)", "empty statement": "pass"}
    number = 100_000
    return {k: min(timeit.repeat(s, globals=names, number=number, repeat=7)) / number * 1e9 for k, s in parts.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from warploop.args import positive_int

    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--bundle", help="prebuilt bundle of the kernels file (default: build one now)")
    parser.add_argument("--source", default=str(DEFAULT_SOURCE), help="the kernels file (for the Triton JIT side)")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--repeats", type=positive_int, default=3, help="fresh processes per side for the cold start")


def main(args: argparse.Namespace) -> int:
    from warploop.bench.common import emit, header
    from warploop.target import select_device

    info = select_device()
    gpu = info.target.backend == "cuda"
    device = None if info.target.is_gpu else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        path = args.bundle
        if path is None:
            from warploop.bundle.build import build_bundle
            path = os.path.join(tmp, "kernels.wlb")
            targets = ["cpu"] + ([str(info.target)] if info.target.is_gpu else [])
            build_bundle(args.source, targets, path, progress=False)
        # Warm the page cache for Python, numpy and torch first, then alternate the kinds of fresh process,
        # so none pays for coming first; each Triton run gets its own empty cache.
        subprocess.run([sys.executable, "-c", "import numpy, torch"], check=True)
        runs: dict[str, list[dict]] = {"numpy": [], "bundle": [], "triton": []}
        floor: list[float] = []
        for r in range(args.repeats):
            if gpu:
                proc, wall = timed_process([sys.executable, "-c", FLOOR])
                floor.append(wall if proc.returncode == 0 else float("nan"))
                runs["numpy"].append(run_child("numpy", path, device))
            runs["bundle"].append(run_child("bundle", path, device))
            if gpu:
                cache = os.path.join(tmp, f"triton-cache-{r}")
                runs["triton"].append(run_child("triton", args.source, None, {"TRITON_CACHE_DIR": cache}))
        launch, launch_error = None, None
        if gpu:
            try:  # keep the correctness and cold-start results even if this part fails
                launch = launch_overhead(path, Path(args.source))
            except Exception as e:
                launch_error = f"{type(e).__name__}: {e}"
    light, ours, theirs = runs["numpy"], runs["bundle"], runs["triton"]
    fastest = light or ours  # the lightest bundle process this device runs: torch-free on a GPU

    def med(side: list[dict], key: str) -> float | None:
        return statistics.median(r[key] for r in side) if side else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    bundle_runs = light + ours
    data = header("bundle") | {
        "kernels": [{"name": k, **v} for k, v in fastest[0]["results"].items()],
        # on a GPU the bundle paths must also have run without Triton, and the numpy path without torch
        "all_correct": all(v["ok"] for r in bundle_runs for v in r["results"].values())
        and not (gpu and any(r["triton_imported"] for r in bundle_runs))
        and not any(r["torch_imported"] for r in light),
        "triton_imported_on_bundle_path": any(r["triton_imported"] for r in bundle_runs),
        "torch_imported_on_numpy_path": any(r["torch_imported"] for r in light) if light else None,
        # whole fresh process, start to exit: interpreter, imports, context, inputs, load/compile, first runs, checks
        "cold_start_s": med(fastest, "wall_s"),
        "cold_start_imports": "warploop, cuda.bindings, numpy" if light else "warploop, torch, triton (CPU executor)",
        "cold_start_floor_s": statistics.median(floor) if floor else None,
        "cold_start_torch_s": med(ours, "wall_s"),
        "triton_cold_start_s": med(theirs, "wall_s"),
        "cold_start_speedup": ratio(med(theirs, "wall_s"), med(fastest, "wall_s")),
        "cold_start_torch_speedup": ratio(med(theirs, "wall_s"), med(ours, "wall_s")),
        # from inputs ready (imports done, CUDA context made) to every kernel checked
        "kernel_start_numpy_s": med(light, "kernels_s"),
        "kernel_start_s": med(ours, "kernels_s"),
        "triton_kernel_start_s": med(theirs, "kernels_s"),
        "kernel_start_speedup": ratio(med(theirs, "kernels_s"), med(ours, "kernels_s")),
        "triton_all_correct": all(v["ok"] for r in theirs for v in r["results"].values()) if theirs else None,
        "launch_us": launch["warploop"] if launch else None,
        "launch_array_us": launch["warploop_array"] if launch else None,
        "triton_launch_us": launch["triton"] if launch else None,
        "raw_launch_us": launch["raw"] if launch else None,
        "launch_over_raw_us": launch["warploop"] - launch["raw"] if launch else None,
        "launch_array_over_raw_us": launch["warploop_array"] - launch["raw"] if launch else None,
        "launch_details": launch,
        "launch_error": launch_error,
        "children": {"numpy": light or None, "bundle": ours, "triton": theirs or None},
    }
    if args.json:
        emit(data, args.out)
    else:
        _summary(data)
    return 0 if data["all_correct"] else 1


def _summary(data: dict) -> None:
    def fmt(v, unit):
        return "n/a" if v is None else f"{v:.3g} {unit}"

    print(f"bundle bench on {data['device']} ({data['target']}), {data['date']}")
    for k in data["kernels"]:
        print(f"  {k['name']:<11} {k['variant']:<8} rel err {k['rel_err']:.1e}  {'ok' if k['ok'] else 'WRONG'}")
    print(f"cold start: bundle {fmt(data['cold_start_s'], 's')} ({data['cold_start_imports']}), with torch "
          f"{fmt(data['cold_start_torch_s'], 's')}, Triton JIT {fmt(data['triton_cold_start_s'], 's')}")
    print(f"launch: warploop {fmt(data['launch_us'], 'us')} (DeviceArrays {fmt(data['launch_array_us'], 'us')}), "
          f"Triton {fmt(data['triton_launch_us'], 'us')}, raw cuLaunchKernel {fmt(data['raw_launch_us'], 'us')}")
