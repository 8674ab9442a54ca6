"""`warploop bench bundle`: bundles vs Triton's JIT on correctness, cold start and launch overhead.

1. Correctness: every kernel of examples/kernels.py, loaded from the bundle in a fresh process where
   `import triton` fails, against a torch reference (relative error, outputs poisoned first).
2. Cold start: a fresh process to the first correct result of every kernel, bundle vs Triton JIT with
   an empty TRITON_CACHE_DIR. Both import torch and make the same inputs; the child also reports how
   much of its time went to kernels (load/compile + first launches) rather than Python and torch.
3. Launch overhead (GPU): host time per `add[grid](x, y, out, n)` issue, warploop vs Triton's launcher
   vs a raw cuLaunchKernel with pre-packed arguments (the floor), interleaved rounds, medians.
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

from warploop.bench.common import emit, header

DEFAULT_SOURCE = Path(__file__).resolve().parents[2] / "examples" / "kernels.py"


def make_cases(torch, device: str) -> dict:
    """Kernel name -> (args, grid, output tensor, reference, tolerance); fresh random inputs each call."""
    g = torch.Generator(device="cpu").manual_seed(int(time.time_ns() % 2**31))

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    def poisoned(*shape, dtype=torch.float32):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    F = torch.nn.functional
    n, rows, cols = 5000, 8, 1000
    x, y, w, b = rand(n), rand(n), rand(cols), rand(cols)
    m = rand(rows, cols)
    gate, up = rand(n, dtype=torch.bfloat16), rand(n, dtype=torch.bfloat16)
    ids = torch.randint(0, 50, (16,), generator=g).to(device)
    table, t2 = rand(50, 200), rand(70, 50)
    a, bm = rand(96, 64, dtype=torch.float16), rand(64, 80, dtype=torch.float16)
    y_axpy = y.clone()
    cases = {
        "add": ((x, y, out := poisoned(n), n), (5,), out, x + y, 1e-6),
        "axpy": ((1.5, x, y_axpy, n), (5,), y_axpy, 1.5 * x.double() + y.double(), 1e-6),
        "gelu": ((x, out := poisoned(n), n), (5,), out, F.gelu(x.double()), 1e-5),
        "silu_mul": ((gate, up, out := poisoned(n, dtype=torch.bfloat16), n), (5,), out,
                     F.silu(gate.double()) * up.double(), 1e-2),
        "reduce_sum": ((x, out := torch.zeros(1, device=device), n), (5,), out, x.double().sum().reshape(1), 1e-5),
        "softmax": ((m, out := poisoned(rows, cols), cols, cols), (rows,), out, torch.softmax(m.double(), 1), 1e-5),
        "cumsum": ((m, out := poisoned(rows, cols), cols, cols), (rows,), out, m.double().cumsum(1), 1e-5),
        "layernorm": ((m, w, b, out := poisoned(rows, cols), cols, cols, 1e-5), (rows,), out,
                      F.layer_norm(m.double(), (cols,), w.double(), b.double(), 1e-5), 1e-5),
        "rmsnorm": ((m, w, out := poisoned(rows, cols), cols, cols, 1e-6), (rows,), out,
                    m.double() * torch.rsqrt(m.double().pow(2).mean(1, keepdim=True) + 1e-6) * w.double(), 1e-5),
        "embedding": ((ids, table, out := poisoned(16, 200), 200), (16,), out, table[ids].double(), 0.0),
        "transpose": ((t2, out := poisoned(50, 70), 70, 50), (3, 2), out, t2.t().double(), 0.0),
        "matmul": ((a, bm, out := poisoned(96, 80), 96, 80, 64), (2, 2), out, a.double() @ bm.double(), 1e-3),
    }
    return cases


def check(out, ref, tol: float) -> tuple[bool, float]:
    got = out.double().cpu()
    ref = ref.cpu()
    if not bool(got.isfinite().all()):
        return False, float("nan")
    err = float((got - ref).norm() / max(float(ref.norm()), 1e-30))
    return err <= tol, err


def child(kind: str, path: str, device: str | None) -> None:
    """One fresh process: run every kernel once, check it, print one JSON line of timings."""
    t0 = time.perf_counter()
    if kind == "bundle" and device != "cpu":
        sys.modules["triton"] = None  # the GPU path must not need Triton: make any import of it fail
    import torch
    torch_dev = "cuda" if device != "cpu" and torch.cuda.is_available() else "cpu"
    if torch_dev == "cuda":
        torch.zeros(1, device="cuda")  # CUDA context: paid by both sides, outside the kernel time
    cases = make_cases(torch, torch_dev)
    t1 = time.perf_counter()
    if kind == "bundle":
        import warploop
        bundle = warploop.load_bundle(path, device=device)
        chosen = bundle.chosen()
        launch = {name: bundle[name] for name in cases}
        meta = {name: {} for name in cases}
    else:
        from warploop.bundle.build import import_source
        module = import_source(Path(path))
        launch = {name: getattr(module, name) for name in cases}
        meta = {name: {**k.warploop_exports[0].constexprs, "num_warps": k.warploop_exports[0].num_warps,
                       "num_stages": k.warploop_exports[0].num_stages} for name, k in launch.items()}
        chosen = {name: [{"target": "triton-jit"}] for name in cases}
    t2 = time.perf_counter()
    results = {}
    for name, (args, grid, out, ref, tol) in cases.items():
        launch[name][grid](*args, **meta[name])
        if torch_dev == "cuda":
            torch.cuda.synchronize()
        ok, err = check(out, ref, tol)
        results[name] = {"ok": ok, "rel_err": err, "variant": chosen[name][0]["target"]}
    t3 = time.perf_counter()
    print(json.dumps({"setup_s": t1 - t0, "load_s": t2 - t1, "kernels_s": t3 - t1, "results": results,
                      "triton_imported": "triton" in sys.modules and sys.modules["triton"] is not None}))


def run_child(kind: str, path: str, device: str | None, env: dict | None = None) -> dict:
    cmd = [sys.executable, "-m", "warploop.bench.bundle", "--child", kind, "--path", path]
    if device:
        cmd += ["--device", device]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} child failed:\n{proc.stderr[-4000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "wall_s": wall}


def launch_overhead(bundle_path: str, source: Path, reps: int = 500, rounds: int = 15) -> dict:
    """Host µs per launch of `add` (3 pointers + an int): warploop, Triton, raw cuLaunchKernel."""
    import ctypes

    import torch
    from cuda.bindings import driver as cu

    import warploop
    from warploop.bundle.build import import_source
    from warploop.driver.null import NullDriver

    n = 1024
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    out = torch.empty(n, device="cuda")
    wk = warploop.load_bundle(bundle_path).add
    tk = import_source(source).add
    spec = next(s for s in wk.specs if s.spec.specialize)  # the aligned variant the fast path picks here
    slots = (ctypes.c_uint64 * 6)(x.data_ptr(), y.data_ptr(), out.data_ptr(), n, 0, 0)
    ptrs = (ctypes.c_void_p * 6)(*[ctypes.addressof(slots) + 8 * i for i in range(6)])
    raw_args = (spec.handle, 1, 1, 1, spec.block, 1, 1, spec.variant.shared, None, ctypes.addressof(ptrs), 0)
    launch = cu.cuLaunchKernel
    grid = (1,)

    def run_warploop():
        for _ in range(reps):
            wk[grid](x, y, out, n)

    def run_triton():
        for _ in range(reps):
            tk[grid](x, y, out, n, BLOCK=1024)

    def run_raw():
        for _ in range(reps):
            launch(*raw_args)

    # The launcher's own Python work: the same fast path with the driver call replaced by a no-op.
    null = NullDriver(wk.specs[0].driver.info, record=False, torch_streams=True)
    nk = warploop.load_bundle(bundle_path, driver=null).add
    noop = null.launch_api(1, False, False)

    def run_null():
        for _ in range(reps):
            nk[grid](x, y, out, n)

    def run_noop():
        for _ in range(reps):
            noop(*raw_args)

    methods = {"warploop": run_warploop, "triton": run_triton, "raw": run_raw, "null": run_null, "noop": run_noop}
    # For scale: the same driver call through ctypes, without cuda.bindings' argument handling.
    try:
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
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            correct[name] = name in ("null", "noop") or bool(torch.equal(out, x + y))
            if r:  # round 0 warms up (Triton compiles here)
                samples[name].append((t1 - t0) / reps * 1e6)
    spread = {k: max(v) - min(v) for k, v in samples.items()}
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {"warploop": med["warploop"], "triton": med["triton"], "raw": med["raw"],
            "python_work_us": med["null"] - med["noop"], "raw_ctypes_us": med.get("raw_ctypes"),
            "correct": {k: v for k, v in correct.items() if k not in ("null", "noop")},
            "spread_us": spread, "reps": reps, "rounds": rounds}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--bundle", help="prebuilt bundle of examples/kernels.py (default: build one now)")
    parser.add_argument("--source", default=str(DEFAULT_SOURCE), help="the kernels file (for the Triton JIT side)")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per side for the cold start")


def main(args: argparse.Namespace) -> int:
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
        # Warm the page cache for Python and torch first, then alternate the two kinds of fresh process,
        # so neither side pays for coming first; each Triton run gets its own empty cache.
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        runs: dict[str, list[dict]] = {"bundle": [], "triton": []}
        for r in range(args.repeats):
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
    ours, theirs = runs["bundle"], runs["triton"]

    def med(side: list[dict], key: str) -> float | None:
        return statistics.median(r[key] for r in side) if side else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    results = ours[0]["results"]
    data = header("bundle") | {
        "kernels": [{"name": k, **v} for k, v in results.items()],
        # on a GPU the bundle path must also have run without Triton; the CPU executor is Triton's interpreter
        "all_correct": all(v["ok"] for r in ours for v in r["results"].values())
        and not (gpu and any(r["triton_imported"] for r in ours)),
        "triton_imported_on_bundle_path": any(r["triton_imported"] for r in ours),
        # whole fresh process: interpreter start, import torch, CUDA context, inputs, load/compile, first runs
        "cold_start_s": med(ours, "wall_s"),
        "triton_cold_start_s": med(theirs, "wall_s"),
        "cold_start_speedup": ratio(med(theirs, "wall_s"), med(ours, "wall_s")),
        # the same, from inputs ready (torch imported, CUDA context made) to every kernel checked
        "kernel_start_s": med(ours, "kernels_s"),
        "triton_kernel_start_s": med(theirs, "kernels_s"),
        "kernel_start_speedup": ratio(med(theirs, "kernels_s"), med(ours, "kernels_s")),
        "triton_all_correct": all(v["ok"] for r in theirs for v in r["results"].values()) if theirs else None,
        "launch_us": launch["warploop"] if launch else None,
        "triton_launch_us": launch["triton"] if launch else None,
        "raw_launch_us": launch["raw"] if launch else None,
        "launch_over_raw_us": launch["warploop"] - launch["raw"] if launch else None,
        "launch_details": launch,
        "launch_error": launch_error,
        "children": {"bundle": ours, "triton": theirs or None},
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
    print(f"cold start: bundle {fmt(data['cold_start_s'], 's')}, Triton JIT {fmt(data['triton_cold_start_s'], 's')}"
          f" (kernels only: {fmt(data['kernel_start_s'], 's')} vs {fmt(data['triton_kernel_start_s'], 's')})")
    print(f"launch: warploop {fmt(data['launch_us'], 'us')}, Triton {fmt(data['triton_launch_us'], 'us')}, "
          f"raw cuLaunchKernel {fmt(data['raw_launch_us'], 'us')}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--child", choices=["bundle", "triton"], required=True)
    p.add_argument("--path", required=True)
    p.add_argument("--device")
    a = p.parse_args()
    child(a.child, a.path, a.device)
