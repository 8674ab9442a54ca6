"""Targets: which GPU family a piece of code is for, and which one this process runs on.

A `Target` keys everything in warploop: bundle variants, loaded-module caches, the runtime's
resident kernel. Its string form (`cuda:90`, `hip:gfx942`, `cpu`) is what users type on the
command line and what bundle manifests store.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re

from warploop import config

BACKENDS = ("cuda", "hip", "cpu")


@dataclasses.dataclass(frozen=True, order=True)
class Target:
    backend: str
    arch: int | str | None = None
    warp_size: int = 32

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; expected one of {', '.join(BACKENDS)}")
        if self.backend == "cuda" and not isinstance(self.arch, int):
            raise ValueError(f"a cuda target needs an integer compute capability (e.g. 90), got {self.arch!r}")
        if self.backend == "hip" and not (isinstance(self.arch, str) and self.arch.startswith("gfx")):
            raise ValueError(f"a hip target needs a gfx architecture name (e.g. gfx942), got {self.arch!r}")

    def __str__(self) -> str:
        return self.backend if self.backend == "cpu" else f"{self.backend}:{self.arch}"

    @classmethod
    def parse(cls, text: str) -> Target:
        """`cuda:90`, `cuda:sm_90`, `hip:gfx942`, `cpu` -> Target (warp size filled in per family)."""
        text = text.strip().lower()
        if text == "cpu":
            return cls("cpu", None, 1)
        m = re.fullmatch(r"cuda:(?:sm_)?(\d+)a?", text)
        if m:
            return cls("cuda", int(m.group(1)), 32)
        m = re.fullmatch(r"hip:(gfx[0-9a-f]+)", text)
        if m:
            return cls("hip", m.group(1), hip_warp_size(m.group(1)))
        raise ValueError(f"cannot parse target {text!r}; write it as cuda:80, cuda:90, hip:gfx942 or cpu")

    @property
    def is_gpu(self) -> bool:
        return self.backend != "cpu"

    def to_dict(self) -> dict:
        return {"backend": self.backend, "arch": self.arch, "warp_size": self.warp_size}


def hip_warp_size(gfx: str) -> int:
    """CDNA (gfx9xx) runs 64-wide wavefronts; RDNA (gfx10xx and later) runs 32-wide by default."""
    return 64 if gfx.startswith("gfx9") else 32


CPU = Target("cpu", None, 1)


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """One device this process can see, with what variant selection and the runtime need."""

    target: Target
    index: int = 0
    name: str = "cpu"
    sm_count: int = 0
    shared_mem_optin: int = 0
    driver_version: int | None = None
    total_memory: int = 0  # bytes of device memory (host memory for the CPU)

    def to_dict(self) -> dict:
        return {"target": str(self.target), **self.target.to_dict(), "index": self.index, "name": self.name,
                "sm_count": self.sm_count, "shared_mem_optin": self.shared_mem_optin,
                "driver_version": self.driver_version, "total_memory": self.total_memory}


class ProbeNote(Exception):
    """Why a backend shows no devices (no binding installed, no driver, no GPU): `warploop info` prints it."""


def _probe_cuda() -> list[DeviceInfo]:
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        raise ProbeNote("cuda.bindings is not installed (pip install 'warploop[cuda]')") from None
    try:
        err, = cu.cuInit(0)
    except Exception as e:  # cuda.bindings loads libcuda lazily, on this first call
        raise ProbeNote(f"cannot load the NVIDIA driver library libcuda ({type(e).__name__}): no driver here") from None
    if err != cu.CUresult.CUDA_SUCCESS:
        raise ProbeNote(f"cuInit failed with {err.name} (no NVIDIA driver or no GPU visible to it)")
    err, count = cu.cuDeviceGetCount()
    if err != cu.CUresult.CUDA_SUCCESS:
        raise ProbeNote(f"cuDeviceGetCount failed with {err.name}")
    _, version = cu.cuDriverGetVersion()
    attr = cu.CUdevice_attribute
    devices = []
    for i in range(count):
        _, dev = cu.cuDeviceGet(i)

        def get(a, dev=dev):
            return cu.cuDeviceGetAttribute(a, dev)[1]

        major = get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        minor = get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        _, raw_name = cu.cuDeviceGetName(256, dev)
        devices.append(DeviceInfo(
            target=Target("cuda", major * 10 + minor, 32), index=i,
            name=raw_name.split(b"\0", 1)[0].decode(errors="replace"),
            sm_count=get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            shared_mem_optin=get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
            driver_version=version, total_memory=cu.cuDeviceTotalMem(dev)[1]))
    return devices


def _probe_hip() -> list[DeviceInfo]:
    try:
        from hip import hip
    except ImportError:
        raise ProbeNote("hip-python is not installed (pip install 'warploop[hip]')") from None
    err, count = hip.hipGetDeviceCount()
    if err != hip.hipError_t.hipSuccess:
        raise ProbeNote(f"hipGetDeviceCount failed with {err.name} (no ROCm driver or no GPU visible to it)")
    _, version = hip.hipDriverGetVersion()
    devices = []
    for i in range(count):
        props = hip.hipDeviceProp_t()
        hip.hipGetDeviceProperties(props, i)
        gfx = props.gcnArchName.decode().split(":", 1)[0]
        devices.append(DeviceInfo(
            target=Target("hip", gfx, props.warpSize), index=i, name=props.name.decode(),
            sm_count=props.multiProcessorCount, shared_mem_optin=props.sharedMemPerBlock,
            driver_version=version, total_memory=props.totalGlobalMem))
    return devices


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[tuple[DeviceInfo, ...], dict[str, str]]:
    gpus: list[DeviceInfo] = []
    notes: dict[str, str] = {}
    for backend, probe in (("cuda", _probe_cuda), ("hip", _probe_hip)):
        try:
            found = probe()
        except ProbeNote as e:
            notes[backend] = str(e)
            continue
        except Exception as e:  # a broken driver install must not stop the CPU path
            notes[backend] = f"probing failed: {type(e).__name__}: {e}"
            continue
        gpus.extend(found)
        if not found:
            notes[backend] = "the driver reports no devices"
    return (*gpus, DeviceInfo(target=CPU, name="cpu", total_memory=_host_memory())), notes


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not every platform names these
        return 0


def probe_devices() -> tuple[DeviceInfo, ...]:
    """Every GPU visible through the vendor drivers (never through Triton), then the CPU."""
    return _probe()[0]


def probe_notes() -> dict[str, str]:
    """backend -> why it contributed no device (absent for backends that found some)."""
    return dict(_probe()[1])


class DeviceNotFoundError(RuntimeError):
    """A backend was asked for (by argument or WARPLOOP_DEVICE) and has no device here."""

    def __init__(self, backend: str, from_env: bool) -> None:
        self.backend, self.from_env = backend, from_env
        visible = ", ".join(str(d.target) for d in probe_devices())
        note = probe_notes().get(backend)
        self.reason = f"no {backend} device found (visible: {visible}" + (f"; {backend}: {note})" if note else ")")
        fix = ("unset WARPLOOP_DEVICE or set WARPLOOP_DEVICE=cpu" if from_env
               else "pass device='cpu', or None to use what is found")
        where = f"WARPLOOP_DEVICE={backend}" if from_env else f"device={backend!r}"
        super().__init__(f"{where}: {self.reason}; {fix}")


def select_device(device: str | Target | DeviceInfo | None = None) -> DeviceInfo:
    """The device work runs on: explicit argument, else WARPLOOP_DEVICE, else the first GPU, else CPU.

    `device` may be a backend (`cuda`), a backend with an index (`cuda:0` is not allowed: use
    `cuda` and CUDA_VISIBLE_DEVICES), a Target or a DeviceInfo.
    """
    if isinstance(device, DeviceInfo):
        return device
    wanted = device if device is not None else config.get().device
    devices = probe_devices()
    if wanted is None or wanted == "auto":
        return devices[0]
    backend = wanted.backend if isinstance(wanted, Target) else str(wanted).lower()
    for info in devices:
        if info.target.backend == backend:
            return info
    raise DeviceNotFoundError(backend, from_env=device is None)
