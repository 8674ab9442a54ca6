"""DeviceArray: GPU memory without torch, for programs that run bundles with nothing heavy imported.

A bundle needs no compiler at run time, and with this it needs no framework either: a program can
allocate, fill from numpy, launch and read back with only warploop, the vendor binding
(cuda.bindings or hip-python) and numpy imported. An array is one C-contiguous allocation from the
device's driver (cuMemAlloc/hipMalloc), freed when the array is garbage collected. It offers what
the launcher reads from a torch tensor (`data_ptr()`, `get_device()`, `dtype`), so `k[grid](...)`
takes it on the same fast path, and `__cuda_array_interface__` for CuPy, Numba and torch.

    x = warploop.driver.from_numpy(np.random.rand(4096).astype(np.float32))
    out = warploop.driver.empty(4096, "float32")
    bundle.add[(4,)](x, x, out, 4096)
    out.to_numpy()          # waits for every kernel on the device, then copies

Copies synchronize the device first, so they never race a kernel on any stream. dtype is the
canonical name the launcher checks ('float32', 'bfloat16', 'int64', ...); numpy has no bfloat16, so
`from_numpy(a, "bfloat16")` rounds floats to nearest even and `to_numpy()` widens to float32 exactly.
"""
from __future__ import annotations

import math
import weakref
from typing import Any

from warploop.driver.base import GpuDriver
from warploop.target import DeviceInfo, Target

# canonical dtype name -> bytes per element; the names are the launcher's (abi.POINTEE_DTYPES)
ITEMSIZE = {"bool": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1, "uint16": 2, "uint32": 4,
            "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_TYPESTR = {"bool": "|b1", "int8": "|i1", "uint8": "|u1", "float16": "<f2", "float32": "<f4", "float64": "<f8",
            "int16": "<i2", "int32": "<i4", "int64": "<i8", "uint16": "<u2", "uint32": "<u4", "uint64": "<u8"}


class DeviceArray:
    """A C-contiguous array in one device allocation. Create it with `empty` or `from_numpy`."""

    # The launcher's fast path reads `_address` and `_index` directly (slot reads, no calls): that is
    # what makes a launch with DeviceArrays cheaper than one with torch tensors.
    __slots__ = ("shape", "dtype", "nbytes", "_address", "_index", "_driver", "__weakref__")

    def __init__(self, shape: tuple[int, ...], dtype: str, driver: GpuDriver):
        self.shape, self.dtype, self._driver, self._index = shape, dtype, driver, driver.info.index
        self.nbytes = math.prod(shape) * ITEMSIZE[dtype]
        self._address = driver.alloc(self.nbytes)
        # Freed with the array; at interpreter exit the process's memory goes with its context anyway.
        weakref.finalize(self, driver.free, self._address).atexit = False

    def data_ptr(self) -> int:
        return self._address

    def get_device(self) -> int:
        """The device ordinal, as torch's `Tensor.get_device()` (the launcher compares it)."""
        return self._index

    @property
    def device(self) -> str:
        return f"{self._driver.backend}:{self._index}"

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def __cuda_array_interface__(self) -> dict:
        typestr = _TYPESTR.get(self.dtype)
        if typestr is None:  # bfloat16 has no typestr; hasattr() is then False, as the protocol expects
            raise AttributeError(f"{self.dtype} has no __cuda_array_interface__ typestr")
        return {"shape": self.shape, "typestr": typestr, "data": (self._address, False), "strides": None,
                "version": 3}

    def to_numpy(self) -> Any:
        """A new numpy array with the contents, once every kernel queued on the device has finished."""
        import numpy as np

        host = np.empty(self.shape, np.uint16 if self.dtype == "bfloat16" else self.dtype)
        self._driver.copy_to_host(host.ctypes.data, self._address, self.nbytes)
        if self.dtype == "bfloat16":
            return (host.astype(np.uint32) << 16).view(np.float32)
        return host

    def copy_from_numpy(self, array: Any) -> DeviceArray:
        """Overwrite the contents with `array` (same number of elements; converted to this dtype)."""
        host = _host_bytes(array, self.dtype)
        if host.size != self.size:
            raise ValueError(f"cannot copy {host.size} elements into a DeviceArray of shape {self.shape}")
        self._driver.copy_from_host(self._address, host.ctypes.data, self.nbytes)
        return self

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d DeviceArray")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, device={self.device!r})"


def _host_bytes(array: Any, dtype: str) -> Any:
    """`array` as a C-contiguous numpy array holding `dtype`'s bytes (bfloat16: rounded to nearest even)."""
    import numpy as np

    if dtype != "bfloat16":
        return np.ascontiguousarray(array, dtype=dtype)
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = ((bits & 0x7F800000) == 0x7F800000) & ((bits & 0x7FFFFF) != 0)
    return np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)  # NaN stays a quiet NaN


def _driver_for(device: str | Target | DeviceInfo | None, driver: GpuDriver | None) -> GpuDriver:
    if driver is not None:
        return driver
    from warploop.driver.select import get_driver
    from warploop.target import select_device

    info = select_device(device)
    chosen = get_driver(info)
    if not isinstance(chosen, GpuDriver):
        raise ValueError(f"DeviceArray needs a GPU, and the selected device is {info.name} ({info.target}); "
                         "on the CPU executor pass numpy arrays or torch tensors instead")
    return chosen


def _check_dtype(dtype: str) -> str:
    if dtype not in ITEMSIZE:
        raise ValueError(f"DeviceArray does not hold {dtype!r}; use one of {', '.join(ITEMSIZE)} "
                         "(or torch tensors for float8)")
    return dtype


def empty(shape: int | tuple[int, ...], dtype: str = "float32", device: str | Target | DeviceInfo | None = None,
          *, driver: GpuDriver | None = None) -> DeviceArray:
    """An uninitialized array on `device` (default: as `load_bundle` picks it); `driver` overrides, as there."""
    dims = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"a DeviceArray shape needs non-negative sizes, got {shape!r}")
    return DeviceArray(dims, _check_dtype(str(dtype)), _driver_for(device, driver))


def from_numpy(array: Any, dtype: str | None = None, device: str | Target | DeviceInfo | None = None,
               *, driver: GpuDriver | None = None) -> DeviceArray:
    """A device copy of `array` (anything numpy converts), as `dtype` (default: the array's own)."""
    import numpy as np

    source = np.asarray(array)
    out = empty(source.shape, dtype or source.dtype.name, device, driver=driver)
    return out.copy_from_numpy(source)
