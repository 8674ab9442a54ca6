"""Vendor drivers, one module per backend, each imported only when a device of its kind is used.

`DeviceArray`, `empty` and `from_numpy` (array.py) give GPU memory without torch; they load on first use.
"""
from __future__ import annotations

from typing import Any

from warploop.driver.base import Driver, DriverError
from warploop.driver.select import get_driver

__all__ = ["DeviceArray", "Driver", "DriverError", "empty", "from_numpy", "get_driver"]


def __getattr__(name: str) -> Any:
    if name in ("DeviceArray", "empty", "from_numpy"):
        from warploop.driver import array
        return getattr(array, name)
    raise AttributeError(f"module 'warploop.driver' has no attribute {name!r}")
