"""Kernel arguments: what a Python object passed for a parameter points at, and whether it fits.

A pointer parameter takes a torch tensor, a `warploop.driver.DeviceArray`, anything with
`__cuda_array_interface__`, `__dlpack__` or `data_ptr()`, a raw integer address, or None (NULL).
Every check here returns a sentence that names the fix, or None; the launcher raises `LaunchError`
with it before anything reaches the driver.
"""
from __future__ import annotations

import ctypes
import dataclasses
import struct
from typing import Any

from warploop.bundle.abi import DLPACK_DTYPES, POINTEE_DTYPES, SCALAR_CODES, TYPESTR_DTYPES, Param

# DLPack device type -> our device kind (https://dmlc.github.io/dlpack/latest/c_api.html)
_DLPACK_DEVICES = {1: "cpu", 2: "cuda", 3: "cpu", 10: "hip", 11: "cpu", 13: "cuda"}


class LaunchError(TypeError):
    """Arguments that do not fit the kernel's signature or specialization; nothing was launched."""


@dataclasses.dataclass(frozen=True)
class PointerArg:
    address: int
    dtype: str | None        # canonical dtype name, None when unknown (raw address)
    device: str | None       # 'cpu', 'cuda', 'hip'; None when unknown
    index: int | None = None  # device ordinal when known


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("byte_offset", ctypes.c_uint64)]


def _from_dlpack(obj: Any) -> PointerArg:
    capsule = obj.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    # A DLManagedTensor starts with its DLTensor; the capsule keeps ownership, so nothing leaks.
    t = _DLTensor.from_address(get(capsule, b"dltensor"))
    kind = _DLPACK_DEVICES.get(t.device.device_type, f"dlpack-device-{t.device.device_type}")
    return PointerArg((t.data or 0) + t.byte_offset, DLPACK_DTYPES.get((t.dtype.code, t.dtype.bits)), kind,
                      None if kind == "cpu" else t.device.device_id)


def pointer_arg(obj: Any) -> PointerArg | None:
    """Where `obj` points, or None if it is not something a pointer parameter accepts."""
    if obj is None:
        return PointerArg(0, None, None)
    if isinstance(obj, int) and not isinstance(obj, bool):
        return PointerArg(obj, None, None)
    if hasattr(obj, "data_ptr") and hasattr(obj, "dtype") and hasattr(obj, "device"):  # torch and look-alikes
        kind = getattr(obj.device, "type", None) or str(obj.device).split(":")[0]  # torch.device, or 'cuda:0'
        # get_device() is what the fast path compares: the GPU ordinal, or -1 for host memory
        index = obj.get_device() if hasattr(obj, "get_device") else getattr(obj.device, "index", None)
        return PointerArg(obj.data_ptr(), str(obj.dtype).removeprefix("torch."), kind, index)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return PointerArg(cai["data"][0], TYPESTR_DTYPES.get(cai["typestr"][1:]), "cuda")
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj)
    return None


def pointer_problem(param: Param, obj: Any, backend: str, index: int) -> str | None:
    """Why `obj` cannot be passed for pointer `param` to a kernel on (backend, index), or None."""
    arg = pointer_arg(obj)
    if arg is None:
        return (f"{param.name} ({param.type}) needs a tensor (torch, or anything with __dlpack__, "
                f"__cuda_array_interface__ or data_ptr()), got {type(obj).__name__}")
    want = POINTEE_DTYPES[param.type[1:]]
    if arg.dtype is not None and arg.dtype != want:
        return f"{param.name} is {arg.dtype} but the kernel was compiled for {want} ({param.type}); pass .to({want})"
    if backend != "cpu" and arg.device is not None and (arg.index != index if arg.index is not None
                                                         else arg.device == "cpu"):
        here = f"{backend}:{index}"
        if arg.device == "cpu":
            return (f"{param.name} is in host memory but the kernel runs on {here}; move it there "
                    f"(e.g. .to('cuda:{index}')) or load the bundle with device='cpu'")
        return f"{param.name} is on device {arg.index} but the kernel was loaded for {here}; move it there"
    return None


def scalar_problem(param: Param, value: Any) -> str | None:
    """Why `value` cannot be passed for scalar `param`, or None."""
    code = SCALAR_CODES[param.type]
    if param.type.startswith(("fp", "bf")):
        if isinstance(value, (int, float)):
            return None
        return f"{param.name} ({param.type}) needs a Python float, got {type(value).__name__}"
    if not isinstance(value, int):
        return f"{param.name} ({param.type}) needs a Python int, got {type(value).__name__}; pass int(...)"
    try:
        struct.pack("<" + code, value)
    except struct.error:
        return f"{param.name}={value} does not fit the kernel's {param.type} parameter"
    return None


def divisibility_problem(param: Param, value: int, divisor: int) -> str | None:
    """A specialization promised `param` divisible by `divisor` (address for pointers); None if it is."""
    if value % divisor == 0:
        return None
    if param.is_pointer:
        return (f"{param.name} is at 0x{value:x}, not {divisor}-byte aligned, but this variant was compiled with "
                f"specialize={{{param.name!r}: {divisor}}}; pass an aligned tensor (e.g. .clone()) "
                f"or also export a variant without that specialization")
    return (f"{param.name}={value} is not a multiple of {divisor}, but this variant was compiled with "
            f"specialize={{{param.name!r}: {divisor}}}; also export a variant without that specialization")
