"""Launching the per-op GPU kernels of ops_kernels.py: from the bundle the package ships, else
through Triton's JIT.

shipped/ops.wlb holds every kernel of ops_kernels.py compiled for cuda:90 and cuda:80 (cuda:8x GPUs
run the cuda:80 cubins, newer ones its PTX); scripts/ops_bundle.py rebuilds it. A launch runs from
the bundle when its first tensor is on a CUDA device and the bundle, loaded once per device, holds
the specialization asked for (kernel, constexprs, dtypes, and the alignment it promises); otherwise
Triton compiles the kernel, as it always did. The bundle path imports no Triton, so a server on a
GPU the bundle covers starts with no compiler. A bundle built from another ops_kernels.py than the
one installed (stale) is never used: one log line says so and how to rebuild it.

    launch("rms_norm_kernel", (rows,), (x, res, w, out, cols, eps), {"HAS_RES": True, "BLOCK": 2048}, num_warps=8)
    listing()      # the shipped specializations, for `warploop info --json` ("prebuilt")
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from warploop.bundle.args import LaunchError

KERNELS = Path(__file__).with_name("ops_kernels.py")
SHIPPED = Path(__file__).parent / "shipped" / "ops.wlb"
TARGETS = ("cuda:90", "cuda:80")
REBUILD = "PYTHONPATH=. python scripts/ops_bundle.py in a checkout, with Triton 3.6.0"
TYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

log = logging.getLogger("warploop.llm")

_lock = threading.Lock()
_bundles: dict[int, Any] = {}        # CUDA device index -> its loaded bundle, or None: that device JITs
_views: dict[tuple, Any] = {}        # (kernel, device, thread, dtype, constexprs) -> bundle kernel or None
_said: set[str] = set()              # what was logged: each reason once a process
_use_bundle = True


def launch(name: str, grid: tuple, args: tuple, constexprs: dict[str, Any], num_warps: int = 4) -> None:
    """Run ops_kernels.`name` over `grid`: from the shipped bundle if it holds this specialization
    for args[0]'s device (its num_warps is then the one exported, which must be `num_warps`), else
    through Triton's JIT."""
    kernel = _prebuilt(name, args[0], constexprs) if _use_bundle else None
    if kernel is not None:
        try:
            kernel[grid](*args)
            return
        except LaunchError as e:   # a promise the arguments break (alignment, a dtype): the JIT takes it
            _say_once(logging.INFO, f"{name}: the shipped bundle's kernel does not fit these arguments ({e}); "
                                    "compiling it with Triton", key=name)
    jit_launch(name, grid, args, constexprs, num_warps)


def jit_launch(name: str, grid: tuple, args: tuple, constexprs: dict[str, Any], num_warps: int) -> None:
    from warploop.llm import ops_kernels  # imports Triton

    getattr(ops_kernels, name)[grid](*args, **constexprs, num_warps=num_warps)


def cuda_index(tensor: Any) -> int | None:
    """The CUDA device `tensor` is on, None elsewhere (the tests stand CPU tensors in for GPU ones here)."""
    device = tensor.device
    return device.index if device.type == "cuda" else None


def _prebuilt(name: str, first: Any, constexprs: dict[str, Any]) -> Any:
    """The bundle's `name` for these constexprs and first argument's dtype on its device, or None."""
    index = cuda_index(first)
    if index is None:
        return None
    key = (name, index, threading.get_ident(), first.dtype, *constexprs.items())
    try:
        return _views[key]
    except KeyError:
        pass
    bundle = shipped(index)
    dtype = str(first.dtype).removeprefix("torch.")
    kernel = _views[key] = None if bundle is None else view(bundle, name, dtype, constexprs)
    return kernel


def view(bundle: Any, name: str, dtype: str, constexprs: dict[str, Any]) -> Any:
    """`bundle`'s kernel `name` cut down to the specializations with exactly these constexprs whose
    first parameter points to `dtype`, launched from the calling thread (the bundle's generated
    fast path serves one thread: the one it was loaded on), or None if there are none."""
    from warploop.bundle.abi import POINTEE_DTYPES
    from warploop.bundle.launch import Kernel, LoadedSpec

    kernel = bundle.kernels.get(name)
    if kernel is None:
        return None
    first = kernel.runtime_names[0]
    specs = [LoadedSpec(s.kernel_name, s.spec, kernel.arg_names, s.variant, s.fmt, s.driver, s.handle)
             for s in kernel.specs
             if s.spec.constexprs == constexprs and POINTEE_DTYPES.get(s.spec.signature[first][1:]) == dtype]
    return Kernel(name, kernel.arg_names, specs, {}, dict(constexprs)) if specs else None


def shipped(index: int) -> Any:
    """The shipped bundle loaded on CUDA device `index` (once per process), or None where it cannot
    serve (stale, no variant for this GPU, no cuda.bindings, a driver too old: logged once)."""
    try:
        return _bundles[index]
    except KeyError:
        pass
    with _lock:
        if index not in _bundles:
            _bundles[index] = _load(index)
        return _bundles[index]


def _load(index: int) -> Any:
    why = stale()
    if why:
        _say_once(logging.WARNING, f"{why}; the per-op GPU kernels compile with Triton instead")
        return None
    from warploop.bundle.load import load_bundle
    from warploop.target import probe_devices, probe_notes

    info = next((d for d in probe_devices() if d.target.backend == "cuda" and d.index == index), None)
    if info is None:   # no cuda.bindings (the note says so), or a ROCm GPU, which torch also calls cuda
        note = f" ({probe_notes()['cuda']})" if "cuda" in probe_notes() else ""
        _say_once(logging.WARNING, f"{SHIPPED.name}: the CUDA driver shows no device {index}{note}; the per-op GPU "
                                   "kernels compile with Triton instead")
        return None
    try:
        bundle = load_bundle(SHIPPED, info, allow_python=False)
    except (RuntimeError, ValueError, ImportError, OSError) as e:
        _say_once(logging.WARNING, f"{SHIPPED.name} does not load on {info.name} ({info.target}): {e}; the per-op "
                                   "GPU kernels compile with Triton instead")
        return None
    log.debug("%s loaded on %s (%s)", SHIPPED.name, info.name, info.target)
    return bundle


def _say_once(level: int, message: str, key: str | None = None) -> None:
    if (key or message) not in _said:
        _said.add(key or message)
        log.log(level, "%s", message)


@functools.lru_cache(maxsize=1)
def stale() -> str | None:
    """Why the shipped bundle must not be used (missing, unreadable, or built from another
    ops_kernels.py than this one), or None when it is current."""
    from warploop.bundle.format import BundleFile

    try:
        built_from = BundleFile(SHIPPED).manifest.build.get("source_sha256")
    except (ValueError, OSError) as e:
        return f"the shipped bundle {SHIPPED} cannot be read ({e}); rebuild it: {REBUILD}"
    if built_from != source_sha256():
        return (f"the shipped bundle {SHIPPED} was built from another {KERNELS.name} than this one "
                f"(sha256 {str(built_from)[:12]}, not {source_sha256()[:12]}); rebuild it: {REBUILD}")
    return None


def source_sha256() -> str:
    return hashlib.sha256(KERNELS.read_bytes()).hexdigest()


@contextlib.contextmanager
def jit_only() -> Iterator[None]:
    """Launch through Triton's JIT inside the block, bundle or not (to compare the two)."""
    global _use_bundle
    before, _use_bundle = _use_bundle, False
    try:
        yield
    finally:
        _use_bundle = before


def listing() -> list[dict[str, Any]]:
    """The shipped bundle's specializations, for `warploop info --json` under "prebuilt": one entry per
    (kernel, target, dtype, head_dim), {"kind": "ops", "kernel", "target", "dtype" (torch's name),
    "head_dim" (None for kernels without one), "current" (built from this ops_kernels.py)}. Reads
    the manifest only: no Triton, no CUDA."""
    from warploop.bundle.format import BundleFile

    try:
        manifest = BundleFile(SHIPPED).manifest
    except (ValueError, OSError):
        return []
    current = manifest.build.get("source_sha256") == source_sha256()
    seen, out = set(), []
    for kernel in manifest.kernels:
        for s in kernel.specializations:
            # the model's dtype: the half-precision type a kernel points to, else float32 (every
            # kernel also takes float32 tables or scratch, whatever the model's dtype)
            floats = {t[1:] for t in s.spec.signature.values() if t[1:] in TYPE_NAMES and t.startswith("*")}
            dtype = TYPE_NAMES[min(floats - {"fp32"}, default="fp32")]
            head_dim = s.spec.constexprs.get("HEAD_DIM")
            for v in s.variants:
                key = (kernel.name, v.target, dtype, head_dim)
                if key not in seen:
                    seen.add(key)
                    out.append({"kind": "ops", "kernel": kernel.name, "target": v.target, "dtype": dtype,
                                "head_dim": head_dim, "current": current})
    return out
