"""`@warploop.task`: mark a Triton device function as a task the resident kernel can run.

    @warploop.task(signature={"x": "*fp32", "n": "i32"}, constexprs={"BLOCK": 256})
    @triton.jit
    def scale(ctx, x, n, BLOCK: tl.constexpr): ...

Parameters are matched by name: `ctx` (optional, first) receives the worker's context record,
which the device library (spawn/join/then/wait) needs; `BACKEND` (optional, a tl.constexpr)
receives the resident kernel's backend ("cuda", "hip", "cpu"), for `wl.wait(ctx, BACKEND)` and
backend-specific code such as inline assembly; every other parameter is either in
`signature` (Triton type strings: `*fp32`, `*bf16`, ..., `i32`, `i64`, `fp32`) or in
`constexprs`. The decorator returns the Triton function itself, with `opcode` and `kinds`
attached so other task bodies can `wl.spawn(ctx, scale, ...)` it.

Opcodes come from a hash of the function's qualified name, so a resident kernel compiled in one
process (or bundled ahead of time) agrees with the host of another.
"""
from __future__ import annotations

import dataclasses
import inspect
import zlib
from collections.abc import Callable

from warploop.runtime.descriptor import FIRST_TASK_OPCODE, K_FP32, K_INT, K_NONE, K_PTR, MAX_ARGS, MAX_OPCODE, fp32_bits

SCALAR_TYPES = {"i32": K_INT, "i64": K_INT, "fp32": K_FP32}
ALIGN = 16      # the divisibility a ":16" type suffix promises
POINTEE_TYPES = ("fp32", "fp16", "bf16", "fp64", "i8", "u8", "i16", "i32", "i64", "u32", "u64")


@dataclasses.dataclass(frozen=True)
class ArgSpec:
    """One argument. A `:16` suffix ("*bf16:16", "i32:16") is Triton's divisibility hint: the
    value (a pointer's address) is a multiple of 16. Kernel arguments get it from Triton's
    specialization; task arguments come from descriptor words, so without the hint the compiler
    cannot prove alignment and splits wide loads into 2-byte ones. The host checks the promise."""

    name: str
    type: str

    def __post_init__(self) -> None:
        base, colon, hint = self.type.partition(":")
        if colon and (hint != str(ALIGN) or base == "fp32"):
            raise ValueError(f"argument {self.name!r}: bad hint in {self.type!r}; the only hint is ':{ALIGN}', "
                             f"on a pointer or an integer (e.g. '*bf16:{ALIGN}', 'i32:{ALIGN}')")
        if base.startswith("*"):
            if base[1:] not in POINTEE_TYPES:
                raise ValueError(f"argument {self.name!r}: unknown pointer type {self.type!r}; "
                                 f"use one of {', '.join('*' + t for t in POINTEE_TYPES)}")
        elif base not in SCALAR_TYPES:
            raise ValueError(f"argument {self.name!r}: unsupported type {self.type!r}; "
                             f"use a pointer (*fp32, *bf16, ...) or one of {', '.join(SCALAR_TYPES)}")

    @property
    def base(self) -> str:
        """The type without its hint."""
        return self.type.partition(":")[0]

    @property
    def aligned(self) -> bool:
        return self.type.endswith(f":{ALIGN}")

    @property
    def kind(self) -> int:
        return K_PTR if self.base.startswith("*") else SCALAR_TYPES[self.base]


@dataclasses.dataclass(eq=False)
class Task:
    """A registered task: its Triton function, opcode, argument layout and placement cost."""

    fn: object
    name: str
    opcode: int
    args: tuple[ArgSpec, ...]
    constexprs: dict
    params: tuple[str, ...]
    takes_ctx: bool
    waits_inside: bool
    cost: float
    heavy: bool = False

    def encode(self, values: tuple) -> tuple[int, ...]:
        """Host-side argument packing: Python values -> int64 descriptor slots."""
        if len(values) != len(self.args):
            names = ", ".join(a.name for a in self.args)
            raise TypeError(f"task {self.name} takes {len(self.args)} arguments ({names}), got {len(values)}")
        return tuple(encode_value(spec, value) for spec, value in zip(self.args, values, strict=True))

    def __repr__(self) -> str:
        return f"Task({self.name}, opcode={self.opcode})"


REGISTRY: dict[int, Task] = {}


def encode_value(spec: ArgSpec, value) -> int:
    word = _encode(spec, value)
    if spec.aligned and word % ALIGN:
        raise ValueError(f"argument {spec.name!r} = {word:#x} is declared {spec.type}, a multiple of {ALIGN}, "
                         f"but is not: pass an aligned tensor or value, or drop ':{ALIGN}' from its type")
    return word


def _encode(spec: ArgSpec, value) -> int:
    kind = spec.kind
    if kind == K_PTR:
        if hasattr(value, "data_ptr"):
            return value.data_ptr()
        if isinstance(value, int):
            return value
        raise TypeError(f"argument {spec.name!r} ({spec.type}) needs a tensor or an address, "
                        f"got {type(value).__name__}")
    if kind == K_FP32:
        return fp32_bits(float(value))
    value = int(value)
    bits = 32 if spec.base == "i32" else 64
    if not -(1 << (bits - 1)) <= value < (1 << (bits - 1)):
        raise OverflowError(f"argument {spec.name!r} = {value} does not fit {spec.type}")
    return value


def opcode_for(qualified_name: str) -> int:
    span = MAX_OPCODE + 1 - FIRST_TASK_OPCODE
    return FIRST_TASK_OPCODE + zlib.crc32(qualified_name.encode()) % span


def task(fn=None, *, signature: dict[str, str] | None = None, constexprs: dict | None = None,
         cost: float = 1.0, waits: bool = False, opcode: int | None = None, heavy: bool = False) -> Callable:
    """Register a Triton device function as a task (see the module docstring).

    cost: relative run time, used to place static-graph nodes on workers.
    waits: the body calls `wl.wait(ctx)` itself, after loading inputs that need no predecessor
        (weights), instead of the runtime waiting before the body starts.
    opcode: fix the opcode instead of hashing the name (must be >= 256).
    heavy: the body holds most of a thread's registers (tens of KB of weights in flight). A resident
        kernel with such a task reads each graph instruction's words after the body before it
        (prefetched into L1 on CUDA) instead of holding them in registers across that body, where
        ptxas would spill them and stall on the spill (docs/runtime.md, the instruction path).
        Light bodies keep the default: their next words arrive while they run.
    """
    def register(f):
        raw = getattr(f, "fn", None)
        if raw is None or not callable(raw):
            raise TypeError("@warploop.task goes on top of @triton.jit: stack it above the Triton decorator")
        params = tuple(inspect.signature(raw).parameters)
        sig = dict(signature or {})
        consts = dict(constexprs or {})
        takes_ctx = bool(params) and params[0] == "ctx"
        name = f"{raw.__module__}.{raw.__qualname__}"
        for p in params[1 if takes_ctx else 0:]:
            if p not in sig and p not in consts and p != "BACKEND":
                raise TypeError(f"task {name}: parameter {p!r} needs a type in signature= or a value in constexprs=")
        unknown = (set(sig) | set(consts)) - set(params)
        if unknown:
            raise TypeError(f"task {name}: {sorted(unknown)} are not parameters of the function")
        if waits and not takes_ctx:
            raise TypeError(f"task {name}: waits=True needs a `ctx` first parameter to call wl.wait(ctx)")
        args = tuple(ArgSpec(p, sig[p]) for p in params if p in sig)
        if len(args) > MAX_ARGS:
            raise TypeError(f"task {name}: {len(args)} arguments; a descriptor holds at most {MAX_ARGS}")
        op = opcode_for(name) if opcode is None else opcode
        if not FIRST_TASK_OPCODE <= op <= MAX_OPCODE:
            raise ValueError(f"task {name}: opcode {op} outside {FIRST_TASK_OPCODE}..{MAX_OPCODE}")
        previous = REGISTRY.get(op)
        if previous is not None and previous.name != name:
            raise ValueError(f"tasks {previous.name} and {name} hash to opcode {op}; pass opcode= to one of them")
        t = Task(fn=f, name=name, opcode=op, args=args, constexprs=consts, params=params,
                 takes_ctx=takes_ctx, waits_inside=waits, cost=float(cost), heavy=bool(heavy))
        REGISTRY[op] = t
        f.opcode = op
        f.kinds = tuple(a.kind for a in args) + (K_NONE,) * (MAX_ARGS - len(args))
        f.warploop_task = t
        return f

    return register(fn) if fn is not None else register


def lookup(obj) -> Task:
    """The Task behind a decorated function (or a Task itself)."""
    if isinstance(obj, Task):
        return obj
    t = getattr(obj, "warploop_task", None)
    if t is None:
        raise TypeError(f"{obj!r} is not a task: decorate it with @warploop.task(...) above @triton.jit")
    return t
