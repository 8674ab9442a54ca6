"""Which CUDA driver loads a bundle's cubin and JIT-compiles its PTX, recorded at build, checked at load.

A cubin made by ptxas of CUDA X.Y loads on any driver of CUDA X.0 or newer (NVIDIA's minor version
compatibility, CUDA 11 on); PTX of ISA version I is JIT-compiled only by a driver of the CUDA release
that introduced I, or newer. The driver reports its CUDA version (cuDriverGetVersion: 12040 is
12.4); the tables below turn CUDA versions into the Linux driver a user installs. docs/bundle-format.md
reproduces them.
"""
from __future__ import annotations

import re
from typing import Any

# CUDA release -> oldest Linux x86_64 driver shipped for it (NVIDIA's CUDA Toolkit release notes, table 3).
LINUX_DRIVER = {
    (11, 0): "450.36.06", (11, 1): "455.23", (11, 2): "460.27.03", (11, 3): "465.19.01", (11, 4): "470.42.01",
    (11, 5): "495.29.05", (11, 6): "510.39.01", (11, 7): "515.43.04", (11, 8): "520.61.05",
    (12, 0): "525.60.13", (12, 1): "530.30.02", (12, 2): "535.54.03", (12, 3): "545.23.06", (12, 4): "550.54.14",
    (12, 5): "555.42.02", (12, 6): "560.28.03", (12, 8): "570.26", (12, 9): "575.51.03",
    (13, 0): "580.65.06", (13, 1): "590.44.01",
}
# Triton release -> the CUDA release of the ptxas in its wheel (checked: `knobs.nvidia.ptxas.version`).
TRITON_PTXAS = {"3.6.0": "12.8"}


def parse(version: str | None) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def text(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def driver_cuda(driver_version: int | None) -> tuple[int, int] | None:
    """cuDriverGetVersion's integer (12040) as (12, 4); None when unknown."""
    if not driver_version:
        return None
    return driver_version // 1000, driver_version % 1000 // 10


def cuda_for_ptx_isa(isa: tuple[int, int]) -> tuple[int, int]:
    """The CUDA release that introduced PTX ISA `isa` (8.7 came with 12.8; 12.6 added none)."""
    major, minor = isa
    if major <= 7:
        return 11, minor if major == 7 else 0
    if major == 8:
        return 12, minor if minor <= 5 else minor + 1
    return 13 + major - 9, minor


def linux_driver(cuda: tuple[int, int]) -> str:
    """The oldest Linux driver for CUDA `cuda` (the next release's when this one has no entry)."""
    known = sorted(v for v in LINUX_DRIVER if v >= cuda)
    return LINUX_DRIVER[known[0]] if known else f"a driver for CUDA {text(cuda)}"


def toolchain(triton: str | None, ptxas: str | None, ptx_source: str) -> dict[str, Any]:
    """What a cuda variant records: the tools that made it and the driver each of its formats needs."""
    m = re.search(r"^\.version\s+(\d+\.\d+)", ptx_source, re.M)
    isa = parse(m.group(1)) if m else None
    made_by = parse(ptxas) or (cuda_for_ptx_isa(isa) if isa else None)
    out: dict[str, Any] = {"triton": triton, "ptxas": ptxas, "ptx_isa": text(isa) if isa else None}
    if made_by:
        cubin = (made_by[0], 0)
        out["cubin_needs"] = {"cuda": text(cubin), "linux_driver": linux_driver(cubin)}
    if isa:
        ptx = cuda_for_ptx_isa(isa)
        out["ptx_needs"] = {"cuda": text(ptx), "linux_driver": linux_driver(ptx)}
    return out


def can_load(toolchain_: dict, fmt: str, driver_version: int | None) -> bool:
    """Whether a driver of `driver_version` loads this format (True when either side is unknown)."""
    have = driver_cuda(driver_version)
    needs = toolchain_.get(f"{fmt}_needs")
    return have is None or needs is None or have >= parse(needs["cuda"])


class DriverTooOldError(RuntimeError):
    """The driver can neither load a variant's cubin nor JIT its PTX."""


def too_old(kernel: str, variant: Any, driver_version: int, rebuild: str) -> DriverTooOldError:
    """The error for a cuda variant this driver cannot load in any format, naming both fixes."""
    tc = variant.toolchain
    have = driver_cuda(driver_version)
    needs = tc.get("cubin_needs") or tc["ptx_needs"]
    ptx = tc.get("ptx_needs")
    jit = (f", and cannot JIT its PTX {tc.get('ptx_isa')} either (needs CUDA {ptx['cuda']}, Linux driver "
           f"{ptx['linux_driver']})") if ptx and "ptx" in variant.formats else ""
    usable = sorted((v, t) for t, v in TRITON_PTXAS.items() if parse(v)[0] <= have[0])
    triton = (f"Triton {usable[-1][1]} (ptxas {usable[-1][0]})" if usable else
              f"a Triton whose ptxas is CUDA {have[0]}.x")
    return DriverTooOldError(
        f"{kernel} for {variant.target}: the cubin was made by ptxas {tc.get('ptxas') or '?'} (Triton "
        f"{tc.get('triton') or '?'}) and needs a driver for CUDA {needs['cuda']} (Linux {needs['linux_driver']} "
        f"or newer), but this driver supports CUDA {text(have)}{jit}. Update the driver to "
        f"{needs['linux_driver']} or newer, or rebuild the bundle with {triton} or with TRITON_PTXAS_PATH set to "
        f"the ptxas of a CUDA {have[0]}.x toolkit: `{rebuild}`")
