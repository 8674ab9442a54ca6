"""Targets: which GPU family a piece of code is for, and which one this process runs on.

A `Target` keys everything in warploop: bundle variants, loaded-module caches, the runtime's
resident kernel. Its string form (`cuda:90`, `hip:gfx942`, `cpu`) is what users type on the
command line and what bundle manifests store.
"""
from __future__ import annotations

import dataclasses
import functools
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

    def to_dict(self) -> dict:
        return {"target": str(self.target), **self.target.to_dict(), "index": self.index, "name": self.name,
                "sm_count": self.sm_count, "shared_mem_optin": self.shared_mem_optin,
                "driver_version": self.driver_version}


def _probe_cuda() -> list[DeviceInfo]:
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return []
    err, = cu.cuInit(0)
    if err != cu.CUresult.CUDA_SUCCESS:
        return []
    err, count = cu.cuDeviceGetCount()
    if err != cu.CUresult.CUDA_SUCCESS:
        return []
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
            driver_version=version))
    return devices


def _probe_hip() -> list[DeviceInfo]:
    try:
        from hip import hip
    except ImportError:
        return []
    err, count = hip.hipGetDeviceCount()
    if err != hip.hipError_t.hipSuccess:
        return []
    _, version = hip.hipDriverGetVersion()
    devices = []
    for i in range(count):
        props = hip.hipDeviceProp_t()
        hip.hipGetDeviceProperties(props, i)
        gfx = props.gcnArchName.decode().split(":", 1)[0]
        devices.append(DeviceInfo(
            target=Target("hip", gfx, props.warpSize), index=i, name=props.name.decode(),
            sm_count=props.multiProcessorCount, shared_mem_optin=props.sharedMemPerBlock,
            driver_version=version))
    return devices


@functools.lru_cache(maxsize=1)
def probe_devices() -> tuple[DeviceInfo, ...]:
    """Every GPU visible through the vendor drivers (never through Triton), then the CPU."""
    gpus: list[DeviceInfo] = []
    for probe in (_probe_cuda, _probe_hip):
        try:
            gpus.extend(probe())
        except Exception:  # a broken driver install must not stop the CPU path
            continue
    return (*gpus, DeviceInfo(target=CPU, name="cpu"))


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
    seen = ", ".join(str(d.target) for d in devices)
    raise RuntimeError(f"no {backend} device found (visible: {seen}); "
                       f"unset WARPLOOP_DEVICE or pass device='cpu' to run on the CPU executor")
