"""The small interface every backend implements: load a variant's code, launch it, allocate memory.

GPU drivers expose their launch entry point with cuLaunchKernel's argument order
`(function, gx, gy, gz, bx, by, bz, shared, stream, params_address, extra)`, returning a tuple whose
first item is the error code, so one generated launcher serves CUDA and HIP. The CPU driver runs
the Triton interpreter instead and has `run`.
"""
from __future__ import annotations

import abc
import sys
from collections.abc import Callable
from typing import Any

from warploop.target import DeviceInfo


class DriverError(RuntimeError):
    """A vendor driver call failed; the message names the call and the driver's error."""


class Driver(abc.ABC):
    backend: str = ""

    def __init__(self, info: DeviceInfo):
        self.info = info

    @abc.abstractmethod
    def load(self, image: bytes, fmt: str, entry: str, shared: int) -> Any:
        """Load one binary (cached per image) and return the handle of function `entry` in it."""


class GpuDriver(Driver):
    @abc.abstractmethod
    def launch_api(self, num_ctas: int, cooperative: bool, pdl: bool) -> Callable[..., tuple]:
        """The call that launches a kernel with these flags (cuLaunchKernel's argument order)."""

    def stream_source(self) -> tuple[Callable[[Any], int], Any]:
        """(f, a): `f(a)` is the current stream's handle, 0 for the default stream. Torch's current
        stream when torch is loaded (ROCm torch's too), else always the default stream. A pair rather
        than a closure so the launcher makes one C call, not a Python call, per launch."""
        torch = sys.modules.get("torch")
        raw = getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None)
        return (raw, self.info.index) if raw is not None else (int, 0)

    @abc.abstractmethod
    def as_stream(self, stream: Any) -> Any:
        """A stream (int handle, or object with .cuda_stream; 0 or None: the default) as launch_api takes it."""

    @abc.abstractmethod
    def alloc(self, nbytes: int) -> int:
        """Device memory (at least 16-byte aligned); kernel scratch keeps it for the life of the process."""

    @abc.abstractmethod
    def free(self, address: int) -> None:
        """Return memory from `alloc`; the caller makes sure no queued kernel still uses it."""

    @abc.abstractmethod
    def copy_from_host(self, dst: int, src: int, nbytes: int) -> None:
        """Copy `nbytes` from host address `src` to device address `dst`, after all work queued on the
        device, and return when the host memory may be reused."""

    @abc.abstractmethod
    def copy_to_host(self, dst: int, src: int, nbytes: int) -> None:
        """Copy `nbytes` from device address `src` to host address `dst`, after all work queued on the
        device (any stream), and return when the data is there."""

    @abc.abstractmethod
    def error_text(self, code: Any) -> str:
        """The driver's name and description of an error code."""

    def recover(self, code: Any) -> bool:
        """Fix what made a launch fail with `code`, if it can be fixed here; True means retry."""
        return False
