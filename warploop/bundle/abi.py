"""The kernel ABI: how each Triton signature type crosses from Python into a compiled kernel.

A compiled Triton 3.x kernel takes its non-constexpr parameters in signature order, then two
trailing pointers (global scratch, profile scratch). Every parameter lives in its own 8-byte slot
of one argument buffer, and the driver gets an array of pointers to those slots; `ParamLayout`
describes that buffer once, as data, and is what the bundle manifest records.
"""
from __future__ import annotations

import dataclasses
import struct

SLOT = 8  # bytes per parameter slot in the argument buffer

# Triton scalar type -> struct code (little-endian, one slot each). bf16 is packed by hand (no
# struct code exists for it): see `pack_bf16`.
SCALAR_CODES = {
    "i1": "b", "i8": "b", "i16": "h", "i32": "i", "i64": "q",
    "u1": "B", "u8": "B", "u16": "H", "u32": "I", "u64": "Q",
    "fp16": "e", "bf16": "H", "fp32": "f", "fp64": "d",
}

# Triton pointee type -> canonical dtype name (torch's spelling, without the `torch.` prefix).
POINTEE_DTYPES = {
    "i1": "bool", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
    "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64",
    "fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp64": "float64",
    "fp8e4nv": "float8_e4m3fn", "fp8e5": "float8_e5m2",
    "fp8e4b8": "float8_e4m3fnuz", "fp8e5b16": "float8_e5m2fnuz",
}

# `__cuda_array_interface__` typestr (without byte order) -> canonical dtype name.
TYPESTR_DTYPES = {
    "b1": "bool", "i1": "int8", "i2": "int16", "i4": "int32", "i8": "int64",
    "u1": "uint8", "u2": "uint16", "u4": "uint32", "u8": "uint64",
    "f2": "float16", "f4": "float32", "f8": "float64",
}

# DLPack (type code, bits) -> canonical dtype name.
DLPACK_DTYPES = {
    (0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64",
    (1, 8): "uint8", (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64",
    (2, 16): "float16", (2, 32): "float32", (2, 64): "float64", (4, 16): "bfloat16", (6, 8): "bool",
}


def is_pointer(ty: str) -> bool:
    return ty.startswith("*")


def check_type(name: str, ty: str) -> None:
    """Raise a clear error for a signature type the bundle ABI cannot pass."""
    if is_pointer(ty):
        if ty[1:] not in POINTEE_DTYPES:
            raise ValueError(f"parameter {name!r}: unsupported pointer type {ty!r}; use one of "
                             + ", ".join("*" + t for t in POINTEE_DTYPES))
    elif ty not in SCALAR_CODES:
        raise ValueError(f"parameter {name!r}: unsupported type {ty!r}; use a pointer like '*fp32' or one of "
                         + ", ".join(SCALAR_CODES) + " (tensor descriptors are not supported in bundles)")


def pack_bf16(value: float) -> int:
    """bf16 bits of a Python float, rounded to nearest even (what torch does)."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    if (bits & 0x7F800000) == 0x7F800000 and bits & 0x7FFFFF:  # NaN stays a quiet NaN
        return (bits >> 16) | 0x40
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    type: str  # Triton type string: '*fp32', 'i32', ... or 'constexpr'

    @property
    def is_constexpr(self) -> bool:
        return self.type == "constexpr"

    @property
    def is_pointer(self) -> bool:
        return is_pointer(self.type)

    def to_dict(self) -> dict:
        return {"name": self.name, "type": self.type}

    @classmethod
    def from_dict(cls, d: dict) -> Param:
        return cls(d["name"], d["type"])


SCRATCH_PARAMS = (Param("global_scratch", "*i8"), Param("profile_scratch", "*i8"))


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """The argument buffer of one kernel: the runtime parameters, then the two scratch pointers."""

    params: tuple[Param, ...]

    @classmethod
    def of(cls, params: list[Param] | tuple[Param, ...]) -> ParamLayout:
        return cls(tuple(p for p in params if not p.is_constexpr) + SCRATCH_PARAMS)

    @property
    def user_count(self) -> int:
        return len(self.params) - len(SCRATCH_PARAMS)

    @property
    def size(self) -> int:
        return SLOT * len(self.params)

    def struct_format(self, count: int | None = None) -> str:
        """struct format of the first `count` slots (all by default), each padded to 8 bytes."""
        out = ["<"]
        for p in self.params[:count]:
            code = "Q" if p.is_pointer else SCALAR_CODES[p.type]
            pad = SLOT - struct.calcsize("<" + code)
            out.append(code + (f"{pad}x" if pad else ""))
        return "".join(out)

    def to_list(self) -> list[dict]:
        return [{"name": p.name, "type": p.type, "offset": SLOT * i} for i, p in enumerate(self.params)]
