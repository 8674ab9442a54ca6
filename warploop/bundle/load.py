"""`warploop.load_bundle(path, device=None)`: pick each kernel's variant for this device and load it.

Variant selection, for each specialization of each kernel (also in docs/bundle-format.md):

  1. exact (backend, arch): the cubin of `cuda:90` on a 9.0 GPU, the hsaco of `hip:gfx942` on gfx942;
  2. NVIDIA only: a cubin of the same major arch and a lower minor (sm_80 on an 8.6 GPU), never an
     arch-specific `sm_XXa` cubin, which runs only on exactly XX (sm_90a only on 9.0);
  3. NVIDIA only: PTX for the newest arch not newer than the device, JIT-compiled by the driver
     (sm_80 PTX on a 9.0 or 12.0 GPU), again never arch-specific PTX;
  4. the cpu variant, run by the Triton interpreter (with a warning when a GPU was asked for), unless
     allow_python=False: that variant is Python source from the bundle, and loading it runs it;
  5. otherwise `NoVariantError`, naming what the bundle holds and the command that rebuilds it.

A cuda variant's cubin is loaded only if the driver's CUDA version is at least the one recorded at build
(cuda_compat.py), else its PTX if the driver can JIT that PTX ISA, else `DriverTooOldError` names the
driver and the Triton to rebuild with. A cubin the driver refuses anyway falls back to its PTX the same way.

Nothing here imports Triton: GPU variants load through the vendor driver. Loading checks the file
(hashes), the device's shared memory, and fails before any launch if a kernel cannot run here.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence

from warploop.bundle import cuda_compat
from warploop.bundle.format import BundleFile, KernelEntry, Manifest, Variant
from warploop.bundle.launch import Kernel, LoadedSpec, priority
from warploop.driver import Driver, DriverError, get_driver
from warploop.target import CPU, DeviceInfo, Target, select_device

BINARY_FORMAT = {"cuda": "cubin", "hip": "hsaco", "cpu": "source"}


class NoVariantError(RuntimeError):
    """The bundle has nothing that runs on this device."""


class SharedMemoryError(RuntimeError):
    """Every variant of a kernel needs more shared memory than this device has."""


def select_variant(variants: Sequence[Variant], target: Target,
                   allow_python: bool = True) -> tuple[Variant, str] | None:
    """(variant, format to load) for `target` by the rules in this module's docstring, or None."""
    parsed = [(Target.parse(v.target), v) for v in variants]
    if target.backend != "cpu":
        for t, v in parsed:
            if t == target:
                return v, BINARY_FORMAT[t.backend]
    if target.backend == "cuda":
        portable = [(t.arch, v) for t, v in parsed if t.backend == "cuda" and not v.arch_specific]
        same_major = [(a, v) for a, v in portable if a // 10 == target.arch // 10 and a < target.arch]
        if same_major:
            return max(same_major, key=lambda av: av[0])[1], "cubin"
        older = [(a, v) for a, v in portable if a <= target.arch and "ptx" in v.formats]
        if older:
            return max(older, key=lambda av: av[0])[1], "ptx"
    for t, v in parsed:
        if t == CPU and allow_python:
            return v, "source"
    return None


def cuda_format(kernel: str, variant: Variant, fmt: str, info: DeviceInfo, rebuild: str) -> str:
    """The format of a cuda variant that this driver loads: `fmt`, else the variant's PTX if the driver
    can JIT it, else DriverTooOldError. Variants built before this check existed always pass."""
    if cuda_compat.can_load(variant.toolchain, fmt, info.driver_version):
        return fmt
    if fmt == "cubin" and "ptx" in variant.formats and \
            cuda_compat.can_load(variant.toolchain, "ptx", info.driver_version):
        warnings.warn(f"{kernel}: the driver (CUDA {cuda_compat.text(cuda_compat.driver_cuda(info.driver_version))}) "
                      f"is older than the cubin for {variant.target} needs; JIT-compiling its PTX instead "
                      f"(slower to load; update the driver to skip it)", stacklevel=4)
        return "ptx"
    raise cuda_compat.too_old(kernel, variant, info.driver_version, rebuild)


def shared_memory_problem(kernel: str, label: str, variant: Variant, info: DeviceInfo) -> str | None:
    """Why `variant` cannot run on `info` for lack of shared memory, or None (also when unknown)."""
    if variant.target == "cpu" or not info.shared_mem_optin or variant.shared <= info.shared_mem_optin:
        return None
    return (f"{kernel} [{label}] needs {variant.shared} bytes of shared memory per program, but {info.name} "
            f"({info.target}) allows {info.shared_mem_optin}; export it with smaller blocks or fewer num_stages "
            f"and rebuild, or load the bundle with device='cpu'")


class Bundle:
    """A loaded bundle: each kernel is an attribute (and an item), launched as `bundle.name[grid](*args)`."""

    def __init__(self, path: str, device: DeviceInfo, manifest: Manifest, kernels: dict[str, Kernel]):
        self.path, self.device, self.manifest, self.kernels = path, device, manifest, kernels
        for name, kernel in kernels.items():
            if not hasattr(type(self), name):
                setattr(self, name, kernel)

    def __getitem__(self, name: str) -> Kernel:
        return self.kernels[name]

    def __getattr__(self, name: str) -> Kernel:  # only reached for names that are not kernels
        raise AttributeError(f"bundle {os.path.basename(self.path)} has no kernel {name!r}; "
                             f"it has {', '.join(self.kernels) or 'none'}")

    def __iter__(self) -> Iterator[str]:
        return iter(self.kernels)

    def __repr__(self) -> str:
        return f"<warploop bundle {os.path.basename(self.path)} on {self.device.target}: {', '.join(self.kernels)}>"

    def chosen(self) -> dict[str, list[dict]]:
        """What each kernel runs: per specialization, the variant's target and the format loaded."""
        return {name: [{"spec": s.label, "target": s.variant.target, "format": s.fmt} for s in k.specs]
                for name, k in self.kernels.items()}


def _load_kernel(bundle: BundleFile, entry: KernelEntry, info: DeviceInfo, driver: Driver | None,
                 allow_python: bool) -> Kernel | str:
    """The loaded kernel, or why no variant of it runs on `info`."""
    order = priority([s.spec for s in entry.specializations])
    specs, unavailable = [], {}
    arg_names = list(entry.arg_names)
    for i in order:
        specialization = entry.specializations[i]
        label = specialization.spec.label()
        choice = select_variant(specialization.variants, info.target, allow_python)
        if choice is None:
            unavailable[label] = "no variant for this device"
            continue
        variant, fmt = choice
        why = shared_memory_problem(entry.name, label, variant, info)
        if why:
            unavailable[label] = why
            continue
        device = info if variant.target != "cpu" else DeviceInfo(target=CPU, name="cpu")
        if device.target != info.target and info.target.is_gpu:
            rebuild = bundle.manifest.rebuild_command(str(info.target))
            warnings.warn(f"{entry.name} [{label}] has no {info.target} variant in {bundle.path}; it runs on the "
                          f"CPU executor, which is slow. Rebuild with `{rebuild}`", stacklevel=3)
        rebuild = bundle.manifest.rebuild_command(str(info.target))
        if device.target.backend == "cuda":
            fmt = cuda_format(entry.name, variant, fmt, info, rebuild)
        chosen = driver if driver is not None and device == info else get_driver(device)
        try:
            handle = chosen.load(_image(bundle, entry, variant, fmt), fmt, variant.entry, variant.shared)
        except DriverError as e:   # a cubin the driver refuses though its version passed: try the PTX
            if fmt != "cubin" or "ptx" not in variant.formats or \
                    not cuda_compat.can_load(variant.toolchain, "ptx", info.driver_version):
                raise
            warnings.warn(f"{entry.name}: {e}; JIT-compiling its PTX instead", stacklevel=3)
            fmt = "ptx"
            handle = chosen.load(_image(bundle, entry, variant, fmt), fmt, variant.entry, variant.shared)
        specs.append(LoadedSpec(entry.name, specialization.spec, arg_names, variant, fmt, chosen, handle))
    if not specs:
        return "; ".join(f"[{label}] {why}" for label, why in unavailable.items())
    return Kernel(entry.name, arg_names, specs, unavailable, dict(entry.specializations[0].spec.constexprs))


def _image(bundle: BundleFile, entry: KernelEntry, variant: Variant, fmt: str) -> bytes:
    return bundle.blob(variant.formats[fmt], what=f"{fmt} of {entry.name} for {variant.target}")


def load_bundle(path: str | os.PathLike, device: str | Target | DeviceInfo | None = None, *,
                driver: Driver | None = None, allow_python: bool = True, sha256: str | None = None) -> Bundle:
    """Load a bundle for `device` (default: WARPLOOP_DEVICE, else the first GPU, else the CPU).

    A bundle is code: its cpu variant is Python source, run when it is loaded. `allow_python=False`
    loads only GPU variants (nothing from the bundle runs in this process; on the CPU it then cannot
    load at all). `sha256` refuses any file but the one with that SHA-256 (hex), before reading its
    manifest. `driver` replaces the vendor driver for `driver.info`'s device (tests and benchmarks
    pass a `warploop.driver.null.NullDriver`)."""
    bundle = BundleFile(path, sha256=sha256)
    info = driver.info if driver is not None else select_device(device)
    if info.target == CPU and not allow_python:
        raise NoVariantError(f"{bundle.path}: on the CPU a bundle runs its cpu variant, which is Python source from "
                             f"the bundle, and allow_python=False forbids that; load it on a GPU, or pass "
                             f"allow_python=True if you trust the file (pin it with sha256=...)")
    kernels, missing, smem = {}, [], []
    for entry in bundle.manifest.kernels:
        loaded = _load_kernel(bundle, entry, info, driver, allow_python)
        if isinstance(loaded, Kernel):
            kernels[entry.name] = loaded
        elif "shared memory" in loaded:
            smem.append(loaded)
        else:
            missing.append(entry.name)
    if missing:
        held = sorted({v.target for k in bundle.manifest.kernels for s in k.specializations for v in s.variants})
        raise NoVariantError(
            f"{bundle.path} has no variant of {', '.join(missing)} that runs on {info.name} ({info.target}); "
            f"it holds {', '.join(held) or 'nothing'}. Rebuild it for this device with "
            f"`{bundle.manifest.rebuild_command(str(info.target))}`" +
            (" (add -t cpu to run anywhere on the CPU executor)" if allow_python else
             " (its cpu variant, if any, was not considered: allow_python=False)"))
    if smem:
        raise SharedMemoryError("; ".join(smem))
    return Bundle(bundle.path, info, bundle.manifest, kernels)
