"""Launching a loaded kernel: `kernel[grid](*args)`.

Each kernel holds its specializations in priority order (most specialized first, then the order
they were written in). A launch that names no constexpr uses the constexpr values of the export
written first; among the specializations with the launch's constexprs (and num_warps/num_stages, if
given) it takes the first whose dtypes and alignment promises the arguments satisfy. GPU kernels get
a generated fast path (see fastpath.py) for the common call shape; everything else, and every error
message, goes through `Kernel.general`, written plainly here.
"""
from __future__ import annotations

import ctypes
import functools
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any

from warploop.bundle.abi import SLOT, ParamLayout, pack_bf16
from warploop.bundle.args import LaunchError, divisibility_problem, pointer_arg, pointer_problem, scalar_problem
from warploop.bundle.export import ExportSpec
from warploop.bundle.format import Variant
from warploop.driver.base import Driver, DriverError

META_KEYS = ("num_warps", "num_stages")


class LoadedSpec:
    """One specialization of a kernel, loaded on one device and ready to launch."""

    def __init__(self, kernel_name: str, spec: ExportSpec, arg_names: list[str], variant: Variant, fmt: str,
                 driver: Driver, handle: Any):
        self.kernel_name, self.spec, self.variant, self.fmt = kernel_name, spec, variant, fmt
        self.driver, self.handle = driver, handle
        self.params = tuple(spec.params(arg_names))
        self.runtime = tuple(p for p in self.params if not p.is_constexpr)
        self.label = spec.label()
        self.is_gpu = driver.backend != "cpu"
        if self.is_gpu:
            layout = self.layout = ParamLayout.of(self.params)
            self.pack_into = struct.Struct(layout.struct_format(layout.user_count)).pack_into
            # The driver reads the argument buffer during the launch call, with the GIL released, so each
            # thread packs into its own buffer; the loading thread's is kept at hand for the fast path.
            self._buffers: dict[int, tuple[Any, int, Any]] = {}
            self.owner = threading.get_ident()
            self.buffer, self.params_address = self.arg_buffer(self.owner)
            self.scratch_offset = SLOT * layout.user_count
            self.block = variant.warp_size * variant.num_warps
            self.api = driver.launch_api(variant.num_ctas, variant.cooperative, variant.pdl)
            self._stream_source: tuple[Callable[[Any], int], Any] | None = None
            self._scratch: dict[Any, tuple[int, int, int]] = {}  # stream -> (programs, global, profile)

    def stream_source(self) -> tuple[Callable[[Any], int], Any]:
        """The driver's current-stream source, taken at the first launch: torch is loaded by then."""
        if self._stream_source is None:
            self._stream_source = self.driver.stream_source()
        return self._stream_source

    def forget_stream_source(self) -> None:
        self._stream_source = None

    def arg_buffer(self, thread: int) -> tuple[Any, int]:
        """(argument buffer, address of its slot-pointer array) for one thread."""
        entry = self._buffers.get(thread)
        if entry is None:
            n = len(self.layout.params)
            buffer = (ctypes.c_char * self.layout.size)()
            slots = (ctypes.c_void_p * n)(*[ctypes.addressof(buffer) + SLOT * i for i in range(n)])
            entry = self._buffers[thread] = (buffer, ctypes.addressof(slots), slots)
        return entry[0], entry[1]

    def meta(self) -> dict[str, Any]:
        return {**self.spec.constexprs, "num_warps": self.spec.num_warps, "num_stages": self.spec.num_stages}

    def meta_mismatch(self, meta: dict[str, Any]) -> str | None:
        """Why a launch asking for these constexpr/num_warps/num_stages values cannot use this one."""
        mine = self.meta()
        for key, value in meta.items():
            if mine[key] != value:
                return f"compiled with {key}={mine[key]}, not {value}"
        return None

    def mismatch(self, named: dict[str, Any]) -> str | None:
        """Why these arguments cannot use this specialization, or None if they can."""
        backend, index = self.driver.backend, self.driver.info.index
        for p in self.runtime:
            value = named[p.name]
            why = pointer_problem(p, value, backend, index) if p.is_pointer else scalar_problem(p, value)
            if why:
                return why
            divisor = self.spec.specialize.get(p.name)
            if divisor:
                why = divisibility_problem(p, pointer_arg(value).address if p.is_pointer else value, divisor)
                if why:
                    return why
        return None

    def grid3(self, grid: Any, named: dict[str, Any]) -> tuple[int, int, int]:
        if callable(grid):
            grid = grid({**named, **self.meta()})
        if isinstance(grid, int):
            grid = (grid,)
        try:
            dims = tuple(int(g) for g in grid)
        except TypeError:
            dims = ()
        if not 1 <= len(dims) <= 3 or min(dims) < 0:
            raise LaunchError(f"{self.kernel_name}: the grid must be 1 to 3 non-negative ints (or a callable of the "
                              f"meta dict returning them), got {grid!r}")
        return dims + (1,) * (3 - len(dims))

    def run(self, grid: Any, named: dict[str, Any], stream: Any) -> None:
        gx, gy, gz = self.grid3(grid, named)
        if not self.is_gpu:
            args = {p.name: self.spec.constexprs[p.name] if p.is_constexpr else _for_interpreter(named[p.name])
                    for p in self.params}
            self.driver.run(self.handle, (gx, gy, gz), args)
            return
        values = []
        for p in self.runtime:
            value = named[p.name]
            values.append(pointer_arg(value).address if p.is_pointer else pack_bf16(value) if p.type == "bf16"
                          else value)
        buffer, address = self.arg_buffer(threading.get_ident())
        self.pack_into(buffer, 0, *values)
        if stream is None:
            current, arg = self.stream_source()
            stream = current(arg)
        s = self.driver.as_stream(stream)
        if self.variant.global_scratch_size or self.variant.profile_scratch_size:
            self.set_scratch(buffer, gx * gy * gz, s)
        ret = self.api(self.handle, gx, gy, gz, self.block, 1, 1, self.variant.shared, s, address, 0)
        if ret[0]:
            self.failed(ret[0], gx * gy * gz, lambda: self.api(self.handle, gx, gy, gz, self.block, 1, 1,
                                                               self.variant.shared, s, address, 0))

    def set_scratch(self, buffer: Any, programs: int, stream: Any) -> None:
        """Point the two scratch slots at buffers big enough for `programs` (one set per stream).

        Buffers only grow, by doubling; replaced ones are kept, since a kernel may still be using them."""
        have = self._scratch.get(stream)
        if have is None or have[0] < programs:
            v, count = self.variant, max(programs, 2 * have[0] if have else programs)

            def alloc(size: int, align: int) -> int:
                return self.driver.alloc(count * v.num_ctas * size + align) if size else 0

            g, p = alloc(v.global_scratch_size, v.global_scratch_align), alloc(v.profile_scratch_size,
                                                                             v.profile_scratch_align)
            have = self._scratch[stream] = (count, -(-g // v.global_scratch_align) * v.global_scratch_align,
                                            -(-p // v.profile_scratch_align) * v.profile_scratch_align)
        struct.pack_into("<QQ", buffer, self.scratch_offset, have[1], have[2])

    def failed(self, code: Any, programs: int, retry: Callable[[], tuple]) -> None:
        if programs == 0:
            return  # an empty grid launches nothing, as in Triton
        if self.driver.recover(code):
            code = retry()[0]
            if not code:
                return
        raise DriverError(f"launching {self.kernel_name} [{self.label}] on {self.driver.info.name} failed: "
                          f"{self.driver.error_text(code)}")


def _for_interpreter(value: Any) -> Any:
    """The interpreter takes torch tensors: wrap DLPack objects; raw addresses cannot be followed."""
    if value is None or isinstance(value, (int, float)) or hasattr(value, "data_ptr"):
        return value
    import torch
    return torch.from_dlpack(value)


class Kernel(dict):
    """A bundle kernel: `kernel[grid](*args, stream=None, **constexprs)`.

    It is a dict from grid to launcher so that `kernel[grid]` is a C-level lookup (a Python
    `__getitem__` would add ~0.2 µs to every launch); a new grid is checked and bound once, in
    `__missing__`. A grid is an int, a tuple of 1 to 3 ints, or a callable of the meta dict."""

    MAX_GRIDS = 1024

    def __init__(self, name: str, arg_names: list[str], specs: list[LoadedSpec], unavailable: dict[str, str],
                 default_constexprs: dict[str, Any]):
        super().__init__()
        self.name, self.arg_names, self.specs, self.unavailable = name, arg_names, specs, unavailable
        self.runtime_names = [p.name for p in specs[0].runtime]
        self.constexpr_names = [n for n in arg_names if n not in self.runtime_names]
        # A grid is usually computed from the constexprs (BLOCK), so a launch that names none uses
        # those of the first export written, never silently another export's.
        self.default_constexprs = default_constexprs
        self._make: Callable[[Any], Callable[..., None]] | None = None
        self._made_without_torch = False

    def __missing__(self, grid: Any) -> Callable[..., None]:
        if self._make is None:
            # Generated at the first launch, not at load: by then a caller that uses torch has imported
            # it, and the fast path binds its dtypes and current-stream query.
            self._make = lambda grid: functools.partial(self.general, grid)
            if all(s.is_gpu for s in self.specs):
                from warploop.bundle.fastpath import fast_launcher_factory
                self._make = fast_launcher_factory(self)
                self._made_without_torch = sys.modules.get("torch") is None
        if len(self) >= self.MAX_GRIDS:
            self.clear()
        launch = self[grid] = self._make(grid)
        return launch

    def __bool__(self) -> bool:  # a kernel is never "empty", whatever its grid cache holds
        return True

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other

    def __repr__(self) -> str:
        where = self.specs[0].driver.info.target
        return f"<warploop kernel {self.name}({', '.join(self.arg_names)}) on {where}, {len(self.specs)} variant(s)>"

    def general(self, grid: Any, *args: Any, stream: Any = None, **meta: Any) -> None:
        if self._made_without_torch and sys.modules.get("torch") is not None:
            self._forget_fast_path()  # torch arrived after the first launch: its tensors and streams need it
        named, meta = self.bind(args, meta)
        if not any(n in meta for n in self.constexpr_names):
            meta = {**self.default_constexprs, **meta}
        meta_fits = [s for s in self.specs if s.meta_mismatch(meta) is None]
        problems = []
        for spec in meta_fits:
            why = spec.mismatch(named)
            if why is None:
                spec.run(grid, named, stream)
                return
            problems.append((spec.label, why))
        if not meta_fits:
            problems = [(s.label, s.meta_mismatch(meta)) for s in self.specs]
        problems += [(label, f"not usable on this device: {why}") for label, why in self.unavailable.items()]
        if len(problems) == 1:
            raise LaunchError(f"{self.name}: {problems[0][1]}")
        raise LaunchError(f"no variant of {self.name} fits these arguments:\n  "
                          + "\n  ".join(f"[{label}]: {why}" for label, why in problems))

    def _forget_fast_path(self) -> None:
        """Regenerate the fast path, and take the current-stream source again, at the next launch."""
        self.clear()
        self._make, self._made_without_torch = None, False
        for spec in self.specs:
            spec.forget_stream_source()

    def bind(self, args: tuple, meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Arguments by name, and the constexpr/num_warps/num_stages values the caller asked for."""
        if len(args) == len(self.runtime_names):
            named = dict(zip(self.runtime_names, args, strict=True))
        elif len(args) == len(self.arg_names) and self.constexpr_names:
            named = dict(zip(self.arg_names, args, strict=True))
            for n in self.constexpr_names:
                value = named.pop(n)
                if n in meta and meta[n] != value:
                    raise LaunchError(f"{self.name}: {n} given twice ({value} and {meta[n]})")
                meta[n] = value
        else:
            extra = f", plus optionally {', '.join(self.constexpr_names)} by keyword" if self.constexpr_names else ""
            raise LaunchError(f"{self.name} takes {len(self.runtime_names)} arguments "
                              f"({', '.join(self.runtime_names)}){extra}; got {len(args)}")
        unknown = [k for k in meta if k not in self.constexpr_names and k not in META_KEYS]
        if unknown:
            raise LaunchError(f"{self.name} has no parameter {', '.join(unknown)}; keywords it accepts: "
                              f"{', '.join([*self.constexpr_names, *META_KEYS, 'stream'])}")
        return named, meta


def priority(specs: list[ExportSpec]) -> list[int]:
    """Indices of specs, most specialized first, then in the order they were written."""
    return sorted(range(len(specs)), key=lambda i: -len(specs[i].specialize))
