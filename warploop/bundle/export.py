"""`warploop.export`: mark a Triton kernel for ahead-of-time compilation into a bundle.

    @warploop.export(signature={"x": "*fp32", "y": "*fp32", "out": "*fp32", "n": "i32"},
                     constexprs={"BLOCK": 1024})
    @triton.jit
    def add(x, y, out, n, BLOCK: tl.constexpr): ...

Stack `export` again for another specialization (other constexpr values, num_warps, num_stages, or
alignment: `specialize={"x": 16}` promises that `x` is 16-byte aligned, which lets Triton vectorise
its loads; for an integer it promises divisibility by 16). The decorator returns the kernel unchanged,
so it still runs under Triton's JIT; it only records an `ExportSpec` on it.
"""
from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

from warploop.bundle.abi import Param, check_type

EXPORTS_ATTR = "warploop_exports"


@dataclasses.dataclass(frozen=True)
class ExportSpec:
    """One specialization of an exported kernel: everything the compiler needs besides the source."""

    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 3
    num_ctas: int = 1
    specialize: dict[str, int] = dataclasses.field(default_factory=dict)
    cooperative: bool = False  # launched with the cooperative attribute (grid-wide sync allowed)
    pdl: bool = False          # launched with programmatic dependent launch (sm_90+)

    def __post_init__(self) -> None:
        for name, ty in self.signature.items():
            check_type(name, ty)
        for name, value in self.constexprs.items():
            if not isinstance(value, (bool, int, float, str)):
                raise ValueError(f"constexpr {name!r}={value!r}: bundles store int, float, bool or str values")
        for name, div in self.specialize.items():
            if name not in self.signature:
                raise ValueError(f"specialize names {name!r}, which is not a runtime parameter "
                                 f"(signature has {', '.join(self.signature)})")
            if self.signature[name] not in ("i32", "i64", "u32", "u64") and not self.signature[name].startswith("*"):
                raise ValueError(f"specialize[{name!r}]: only pointers and integers can be specialized")
            if div < 2 or div & (div - 1):
                raise ValueError(f"specialize[{name!r}]={div}: use a power of two such as 16")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps={self.num_warps}: use a power of two (1, 2, 4, 8, ...)")
        if self.num_stages < 1 or self.num_ctas < 1:
            raise ValueError("num_stages and num_ctas must be at least 1")

    def params(self, arg_names: list[str]) -> list[Param]:
        return [Param(n, "constexpr" if n in self.constexprs else self.signature[n]) for n in arg_names]

    def label(self) -> str:
        """Short human description, used in error messages and `bundle inspect`."""
        parts = [f"{k}={v}" for k, v in self.constexprs.items()]
        parts += [f"num_warps={self.num_warps}", f"num_stages={self.num_stages}"]
        parts += [f"{k}%{v}==0" for k, v in self.specialize.items()]
        return ", ".join(parts)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ExportSpec:
        return cls(**d)


def _kernel_parts(kernel: Any) -> tuple[str, list[str], set[str]]:
    """(name, parameter names, constexpr parameter names) of a JITFunction or InterpretedFunction."""
    fn = getattr(kernel, "fn", None)
    if fn is None or not callable(fn):
        raise TypeError("warploop.export decorates a Triton kernel: put it above @triton.jit")
    params = inspect.signature(fn).parameters
    constexpr_names = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
    return fn.__name__, list(params), constexpr_names


def export(signature: dict[str, str], constexprs: dict[str, Any] | None = None, *, num_warps: int = 4,
           num_stages: int = 3, num_ctas: int = 1, specialize: dict[str, int] | None = None,
           cooperative: bool = False, pdl: bool = False) -> Callable[[Any], Any]:
    """Record one bundle specialization of the Triton kernel below; returns the kernel unchanged."""
    spec = ExportSpec(dict(signature), dict(constexprs or {}), num_warps, num_stages, num_ctas,
                      dict(specialize or {}), cooperative, pdl)

    def decorate(kernel: Any) -> Any:
        name, arg_names, constexpr_names = _kernel_parts(kernel)
        given = set(spec.signature) | set(spec.constexprs)
        if given != set(arg_names):
            missing = [n for n in arg_names if n not in given]
            extra = sorted(given - set(arg_names))
            raise ValueError(f"warploop.export on {name}: the kernel's parameters are {', '.join(arg_names)}; "
                             + (f"give a type or constexpr value for {', '.join(missing)}" if missing else "")
                             + ("; " if missing and extra else "")
                             + (f"{', '.join(extra)} is not a parameter" if extra else ""))
        if set(spec.constexprs) != constexpr_names:
            raise ValueError(f"warploop.export on {name}: constexprs must be exactly the tl.constexpr parameters "
                             f"({', '.join(sorted(constexpr_names)) or 'none'}), got {', '.join(spec.constexprs)}")
        specs = getattr(kernel, EXPORTS_ATTR, None)
        if specs is None:
            specs = []
            setattr(kernel, EXPORTS_ATTR, specs)
        if spec in specs:
            raise ValueError(f"warploop.export on {name}: the same specialization is exported twice")
        specs.insert(0, spec)  # decorators apply bottom-up; keep the order they are written in
        return kernel

    return decorate


def exported_kernels(namespace: dict[str, Any]) -> dict[str, tuple[Any, list[ExportSpec], list[str]]]:
    """Kernels in a module's namespace that carry exports: name -> (kernel, specs, parameter names)."""
    out: dict[str, tuple[Any, list[ExportSpec], list[str]]] = {}
    for attr, obj in namespace.items():
        specs = getattr(obj, EXPORTS_ATTR, None) if hasattr(obj, "fn") else None
        if not specs:
            continue
        name, arg_names, _ = _kernel_parts(obj)
        if name != attr:
            continue  # an alias of a kernel already listed under its own name
        out[name] = (obj, list(specs), arg_names)
    return out
