"""One fresh process of `warploop bench bundle`: run every kernel of warploop/bench/kernels.py once and check it.

    python -m warploop.bench.bundle_child KIND PATH [--device cpu]

KIND is how the process reaches its first results, each timed by the parent from start to exit:
  numpy   the bundle with `warploop.driver` DeviceArrays: only warploop, the vendor binding and numpy
          are imported; torch and Triton are made unimportable (GPU only)
  bundle  the bundle with torch tensors; Triton is made unimportable on a GPU
  triton  Triton's JIT with torch tensors (the parent gives it an empty cache; PATH is the source file)
Every kind runs the same cases: fresh random inputs, outputs poisoned with NaN, results compared with
float64 numpy references. It prints one JSON line. This module imports nothing heavy at the top, so
the numpy kind measures a process that never loads a framework.
"""
from __future__ import annotations

import json
import math
import sys
import time
from typing import Any

ArraySpec = tuple[Any, str]  # (numpy array, dtype name): made into a tensor or a DeviceArray by the caller


def _bf16(np: Any, a: Any) -> Any:
    """float32 values rounded to bfloat16 (nearest even), still as float32: inputs every kind can hold exactly."""
    bits = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def make_cases(np: Any) -> dict[str, tuple[list, tuple, int, Any, float]]:
    """Kernel name -> (args, grid, index of the output in args, float64 reference, tolerance)."""
    rng = np.random.default_rng(time.time_ns() % 2**32)

    def rand(*shape: int) -> Any:
        return rng.standard_normal(shape).astype(np.float32)

    def poisoned(*shape: int, dtype: str = "float32") -> ArraySpec:
        return np.full(shape, np.nan, np.float32), dtype

    n, rows, cols = 5000, 8, 1000
    x, y, w, b, m = rand(n), rand(n), rand(cols), rand(cols), rand(rows, cols)
    gate, up = _bf16(np, rand(n)), _bf16(np, rand(n))
    ids, table, t2 = rng.integers(0, 50, 16), rand(50, 200), rand(70, 50)
    a, bm = rand(96, 64).astype(np.float16), rand(64, 80).astype(np.float16)
    f64 = {k: v.astype(np.float64) for k, v in dict(x=x, y=y, w=w, b=b, m=m, gate=gate, up=up, a=a, bm=bm).items()}
    erf = np.frompyfunc(math.erf, 1, 1)
    mean = f64["m"].mean(1, keepdims=True)
    var = ((f64["m"] - mean) ** 2).mean(1, keepdims=True)
    e = np.exp(f64["m"] - f64["m"].max(1, keepdims=True))
    f32 = "float32"
    return {
        "add": ([(x, f32), (y, f32), poisoned(n), n], (5,), 2, f64["x"] + f64["y"], 1e-6),
        "axpy": ([1.5, (x, f32), (y.copy(), f32), n], (5,), 2, 1.5 * f64["x"] + f64["y"], 1e-6),
        "gelu": ([(x, f32), poisoned(n), n], (5,), 1,
                 0.5 * f64["x"] * (1 + erf(f64["x"] / math.sqrt(2)).astype(np.float64)), 1e-5),
        "silu_mul": ([(gate, "bfloat16"), (up, "bfloat16"), poisoned(n, dtype="bfloat16"), n], (5,), 2,
                     f64["gate"] / (1 + np.exp(-f64["gate"])) * f64["up"], 1e-2),
        # a sum's relative error grows with its condition number, sum |x| / |sum x| (the random x may sum near 0)
        "reduce_sum": ([(x, f32), (np.zeros(1, np.float32), f32), n], (5,), 1, f64["x"].sum().reshape(1),
                       float(1e-5 * np.abs(f64["x"]).sum() / max(abs(f64["x"].sum()), 1e-30))),
        "softmax": ([(m, f32), poisoned(rows, cols), cols, cols], (rows,), 1, e / e.sum(1, keepdims=True), 1e-5),
        "cumsum": ([(m, f32), poisoned(rows, cols), cols, cols], (rows,), 1, f64["m"].cumsum(1), 1e-5),
        "layernorm": ([(m, f32), (w, f32), (b, f32), poisoned(rows, cols), cols, cols, 1e-5], (rows,), 3,
                      (f64["m"] - mean) / np.sqrt(var + 1e-5) * f64["w"] + f64["b"], 1e-5),
        "rmsnorm": ([(m, f32), (w, f32), poisoned(rows, cols), cols, cols, 1e-6], (rows,), 2,
                    f64["m"] / np.sqrt((f64["m"] ** 2).mean(1, keepdims=True) + 1e-6) * f64["w"], 1e-5),
        "embedding": ([(ids, "int64"), (table, f32), poisoned(16, 200), 200], (16,), 2,
                      table[ids].astype(np.float64), 0.0),
        "transpose": ([(t2, f32), poisoned(50, 70), 70, 50], (3, 2), 1, t2.T.astype(np.float64), 0.0),
        "matmul": ([(a, "float16"), (bm, "float16"), poisoned(96, 80), 96, 80, 64], (2, 2), 2,
                   f64["a"] @ f64["bm"], 1e-3),
    }


def check(np: Any, got: Any, ref: Any, tol: float) -> tuple[bool, float]:
    got = np.asarray(got, np.float64).reshape(ref.shape)
    if not np.isfinite(got).all():
        return False, float("nan")
    err = float(np.linalg.norm(got - ref) / max(float(np.linalg.norm(ref)), 1e-30))
    return bool(err <= tol), err


def _torch_side(device: str | None) -> tuple[Any, Any, Any]:
    """(make a device tensor from an ArraySpec, read one back as numpy, wait for the GPU)."""
    import torch

    where = "cuda" if device != "cpu" and torch.cuda.is_available() else "cpu"
    if where == "cuda":
        torch.zeros(1, device="cuda")  # the CUDA context, made here so it counts as setup on both sides
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64}

    def to_device(spec: ArraySpec) -> Any:
        return torch.from_numpy(spec[0]).to(device=where, dtype=dtypes[spec[1]])

    sync = torch.cuda.synchronize if where == "cuda" else (lambda: None)
    return to_device, lambda t: t.double().cpu().numpy(), sync


def _array_side(device: str | None) -> tuple[Any, Any, Any]:
    from warploop.driver import from_numpy, get_driver
    from warploop.target import select_device

    get_driver(select_device(device))  # cuda.bindings, cuInit and the context, timed as device set-up
    return (lambda spec: from_numpy(spec[0], spec[1], device)), (lambda a: a.to_numpy()), (lambda: None)


def child(kind: str, path: str, device: str | None) -> dict:
    t0 = time.perf_counter()
    if kind != "triton" and device != "cpu":
        sys.modules["triton"] = None  # the GPU path must not need Triton: make any import of it fail
    if kind == "numpy":
        sys.modules["torch"] = None  # nor torch
    import numpy as np

    t_numpy = time.perf_counter()
    to_device, to_host, sync = (_array_side if kind == "numpy" else _torch_side)(device)
    t_device = time.perf_counter()
    cases = {name: ([to_device(a) if isinstance(a, tuple) else a for a in args], grid, out, ref, tol)
             for name, (args, grid, out, ref, tol) in make_cases(np).items()}
    t1 = time.perf_counter()
    if kind == "triton":
        from pathlib import Path

        from warploop.bundle.build import import_source
        module = import_source(Path(path))
        launch = {name: getattr(module, name) for name in cases}
        meta = {name: {**k.warploop_exports[0].constexprs, "num_warps": k.warploop_exports[0].num_warps,
                       "num_stages": k.warploop_exports[0].num_stages} for name, k in launch.items()}
        chosen = {name: "triton-jit" for name in cases}
    else:
        import warploop
        bundle = warploop.load_bundle(path, device=device)
        launch = {name: bundle[name] for name in cases}
        meta = {name: {} for name in cases}
        chosen = {name: specs[0]["target"] for name, specs in bundle.chosen().items()}
    t2 = time.perf_counter()
    results = {}
    for name, (args, grid, out, ref, tol) in cases.items():
        launch[name][grid](*args, **meta[name])
        sync()
        ok, err = check(np, to_host(args[out]), ref, tol)
        results[name] = {"ok": ok, "rel_err": err, "variant": chosen[name]}
    t3 = time.perf_counter()
    loaded = {m: sys.modules.get(m) is not None for m in ("torch", "triton")}
    # setup = numpy import + device set-up (framework import, driver, context) + inputs on the device
    return {"setup_s": t1 - t0, "numpy_import_s": t_numpy - t0, "device_setup_s": t_device - t_numpy,
            "load_s": t2 - t1, "kernels_s": t3 - t1, "results": results,
            "triton_imported": loaded["triton"], "torch_imported": loaded["torch"]}


if __name__ == "__main__":
    kind_, path_ = sys.argv[1], sys.argv[2]
    device_ = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else None
    print(json.dumps(child(kind_, path_, device_)))
