"""The driver for a device: one per backend module, each imported only when a device of its kind is
used (cuda-bindings and hip-python are optional)."""
from __future__ import annotations

import functools

from warploop.driver.base import Driver
from warploop.target import DeviceInfo


@functools.cache
def get_driver(info: DeviceInfo) -> Driver:
    """The driver for one device, created once per process (it caches loaded modules)."""
    if info.target.backend == "cuda":
        from warploop.driver.cuda import CudaDriver
        return CudaDriver(info)
    if info.target.backend == "hip":
        from warploop.driver.hip import HipDriver
        return HipDriver(info)
    from warploop.driver.cpu import CpuDriver
    return CpuDriver(info)
