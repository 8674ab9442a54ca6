"""Vendor drivers, one module per backend, each imported only when a device of its kind is used.

`DeviceArray`, `empty` and `from_numpy` (array.py) give GPU memory without torch; they load on first use.
"""
from __future__ import annotations

import functools
from typing import Any

from warploop.driver.base import Driver, DriverError
from warploop.target import DeviceInfo

__all__ = ["DeviceArray", "Driver", "DriverError", "empty", "from_numpy", "get_driver"]


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


def __getattr__(name: str) -> Any:
    if name in ("DeviceArray", "empty", "from_numpy"):
        from warploop.driver import array
        return getattr(array, name)
    raise AttributeError(f"module 'warploop.driver' has no attribute {name!r}")
