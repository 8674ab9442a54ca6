"""A GPU driver that runs nothing: it records each launch with the bytes of its argument buffer.

Like tinygrad's ops_null, it lets CPU-only tests drive the real GPU launch path (variant selection,
generated fast path, argument packing, scratch) and lets the benchmark time the launcher's own
Python work with the driver call taken out.
"""
from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable
from typing import Any

from warploop.driver.base import GpuDriver
from warploop.target import DeviceInfo


@dataclasses.dataclass
class Launch:
    function: Any
    grid: tuple[int, int, int]
    block: int
    shared: int
    stream: Any
    params: int  # address of the slot-pointer array, as the driver got it
    flags: tuple[int, bool, bool]  # num_ctas, cooperative, pdl

    def slots(self, count: int) -> list[int]:
        """The first `count` 8-byte argument slots, read through the pointer array as a driver would.
        Read it before the next launch of the same kernel from the same thread reuses the buffer."""
        pointers = ctypes.cast(self.params, ctypes.POINTER(ctypes.c_void_p))
        return [ctypes.c_uint64.from_address(pointers[i]).value for i in range(count)]


class NullDriver(GpuDriver):
    """Pretends to be `info`'s device (e.g. cuda:90, with `index=-1` so CPU tensors pass the device check)."""

    def __init__(self, info: DeviceInfo, record: bool = True, fail_with: int = 0, torch_streams: bool = False):
        super().__init__(info)
        self.backend = info.target.backend
        self.record, self.fail_with, self.torch_streams = record, fail_with, torch_streams
        self.launches: list[Launch] = []
        self.allocations: list[int] = []
        self.freed: list[int] = []
        self._memory: dict[int, Any] = {}

    def load(self, image: bytes, fmt: str, entry: str, shared: int) -> Any:
        return (entry, fmt, len(image))

    def launch_api(self, num_ctas: int, cooperative: bool, pdl: bool) -> Callable[..., tuple]:
        if not self.record:
            return lambda *args: (self.fail_with,)
        flags = (num_ctas, cooperative, pdl)

        def launch(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            self.launches.append(Launch(f, (gx, gy, gz), bx, shared, stream, params, flags))
            return (self.fail_with,)

        return launch

    def stream_source(self) -> tuple[Callable[[Any], int], Any]:
        """The default stream, unless asked to read torch's current stream as a real driver does."""
        return super().stream_source() if self.torch_streams else (int, 0)

    def as_stream(self, stream: Any) -> Any:
        return int(getattr(stream, "cuda_stream", stream) or 0) or None

    def alloc(self, nbytes: int) -> int:
        """Host memory standing in for device memory, so copies and the arrays on it can be checked."""
        block = ctypes.create_string_buffer(max(nbytes, 1))
        address = ctypes.addressof(block)
        self._memory[address] = block
        self.allocations.append(nbytes)
        return address

    def free(self, address: int) -> None:
        del self._memory[address]
        self.freed.append(address)

    def copy_from_host(self, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def copy_to_host(self, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def error_text(self, code: Any) -> str:
        return f"NULL_DRIVER_ERROR {code}"
