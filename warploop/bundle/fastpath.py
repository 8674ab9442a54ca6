"""The generated fast path of a GPU kernel launch.

Per-launch Python work is what separates a launcher from a raw `cuLaunchKernel` call, so for each
kernel we generate straight-line code (as Triton generates its C launcher): argument kinds, dtypes,
slot layout and driver handles are fixed at load time and bound as constants, and a tuple grid is
checked once, when `kernel[grid]` first sees it. The code handles the common call,
`kernel[grid](tensors and scalars...)` with torch tensors or DeviceArrays on this device from the
loading thread;
any other call, and any argument that fails a check, goes to `Kernel.general`, which does the same
launch or raises the precise error. The source is kept as `kernel.fast_source` for reading.
"""
from __future__ import annotations

import struct
import sys
import threading
from collections.abc import Callable
from typing import Any

from warploop.bundle.abi import POINTEE_DTYPES, pack_bf16
from warploop.driver.array import DeviceArray

_MISSING = object()


def _spec_branch(k: int, spec: Any, torch: Any, fixed: bool, env: dict[str, Any]) -> list[str]:
    conds, aligned = [], {}
    for i, p in enumerate(spec.runtime):
        if p.is_pointer:
            # A torch tensor's dtype is its torch.dtype (None when torch is not loaded: never matches);
            # a DeviceArray's is the canonical name, compared only when the first test fails.
            name = POINTEE_DTYPES[p.type[1:]]
            env[f"DT{k}_{i}"] = getattr(torch, name, None) if torch else None
            conds.append(f"(a{i}.dtype is DT{k}_{i} or a{i}.dtype == {name!r})")
        divisor = spec.spec.specialize.get(p.name)
        if divisor and p.is_pointer:
            aligned.setdefault(divisor - 1, []).append(f"p{i}")
        elif divisor:
            conds.append(f"type(a{i}) is int and not a{i} & {divisor - 1}")
    # one test per alignment: (p0 | p1 | p2) & 15 is zero exactly when all three are 16-byte aligned
    conds += [f"not ({' | '.join(ps)}) & {mask}" if len(ps) > 1 else f"not {ps[0]} & {mask}"
              for mask, ps in aligned.items()]
    values = [f"p{i}" if p.is_pointer else f"BF16(a{i})" if p.type == "bf16" else f"a{i}"
              for i, p in enumerate(spec.runtime)]
    env.update({f"PACK{k}": spec.pack_into, f"BUF{k}": spec.buffer, f"PARAMS{k}": spec.params_address,
                f"FN{k}": spec.handle, f"BX{k}": spec.block, f"SH{k}": spec.variant.shared,
                f"LAUNCH{k}": spec.api, f"FAILED{k}": spec.failed, f"GRID{k}": _grid3_of(spec),
                f"SCRATCH{k}": spec.set_scratch})
    call = f"LAUNCH{k}(FN{k}, gx, gy, gz, BX{k}, 1, 1, SH{k}, s, PARAMS{k}, 0)"
    scratch = spec.variant.global_scratch_size or spec.variant.profile_scratch_size
    every = ", ".join(f"a{i}" for i in range(len(spec.runtime)))
    return [
        f"        if {' and '.join(conds) or 'True'}:",
        *([] if fixed else [f"            gx, gy, gz = GRID{k}(grid, ({every},))"]),
        "            try:",
        f"                PACK{k}(BUF{k}, 0, {', '.join(values)})",
        "            except STRUCT_ERROR:",
        f"                return general(grid, {every}{', ' if every else ''}stream=stream)",
        *_stream_lines(spec),
        *([f"            SCRATCH{k}(BUF{k}, gx * gy * gz, s)"] if scratch else []),
        f"            ret = {call}",
        "            if ret[0]:",
        f"                FAILED{k}(ret[0], gx * gy * gz, lambda: {call})",
        "            return",
    ]


def _stream_lines(spec: Any) -> list[str]:
    """`s`, the stream to launch on: the caller's, else the current one; None for the default stream."""
    if spec.stream_source()[0] is int:  # no torch: the current stream is always the default one
        return ["            s = None if stream is None else AS_STREAM(stream)"]
    return ["            s = STREAM(SARG) if stream is None else stream",
            "            s = AS_STREAM(s) if s else None"]


def _grid3_of(spec: Any) -> Callable[[Any, tuple], tuple[int, int, int]]:
    names = [p.name for p in spec.runtime]
    return lambda grid, args: spec.grid3(grid, dict(zip(names, args, strict=True)))


def _launch_source(kernel: Any, fixed: bool, torch: Any, env: dict[str, Any]) -> list[str]:
    """`make_fixed(grid)` (tuple grid, checked here once) or `make_dynamic(grid)` (callable grid)."""
    runtime = kernel.specs[0].runtime
    n = len(runtime)
    every = ", ".join(f"a{i}" for i in range(n))
    sep = ", " if n else ""
    given = f"[a for a in ({every},) if a is not M]" if n else "[]"
    lines = [f"def make_{'fixed' if fixed else 'dynamic'}(grid):"]
    if fixed:
        lines.append("    gx, gy, gz = GRID3(grid)")
    lines += [
        f"    def launch({', '.join(f'a{i}=M' for i in range(n))}{sep}*extra, stream=None, **meta):",
        f"        if {f'a{n - 1} is M or ' if n else ''}extra or meta or IDENT() != OWNER:",
        f"            return general(grid, *{given}, *extra, stream=stream, **meta)",
    ]
    pointers = [i for i, p in enumerate(runtime) if p.is_pointer]
    if pointers:
        # DeviceArrays: two slot reads each; anything else: torch's data_ptr() and get_device() calls.
        lines += [f"        if {' and '.join(f'type(a{i}) is ARRAY' for i in pointers)}:",
                  *[f"            p{i} = a{i}._address" for i in pointers],
                  f"            if {' or '.join(f'a{i}._index != DEV' for i in pointers)}:",
                  f"                return general(grid, {every}, stream=stream)",
                  "        else:",
                  "            try:", *[f"                p{i} = a{i}.data_ptr()" for i in pointers],
                  f"                if {' or '.join(f'a{i}.get_device() != DEV' for i in pointers)}:",
                  f"                    return general(grid, {every}, stream=stream)",
                  "            except AttributeError:  # not a tensor: the general path says what it needs",
                  f"                return general(grid, {every}, stream=stream)"]
    for k, spec in enumerate(kernel.specs):
        if spec.spec.constexprs == kernel.default_constexprs:  # the others need constexpr keywords
            lines += _spec_branch(k, spec, torch, fixed, env)
    return lines + [f"        return general(grid, {every}{sep}stream=stream)", "    return launch"]


def fast_launcher_factory(kernel: Any) -> Callable[[Any], Callable[..., None]]:
    """Generate and compile the code; returns `make(grid) -> launch(*args, stream=None, **meta)`."""
    first = kernel.specs[0]
    torch = sys.modules.get("torch")
    env: dict[str, Any] = {
        "general": kernel.general, "M": _MISSING, "DEV": first.driver.info.index, "STREAM": first.stream_source()[0],
        "SARG": first.stream_source()[1],
        "AS_STREAM": first.driver.as_stream, "STRUCT_ERROR": struct.error, "BF16": pack_bf16,
        "IDENT": threading.get_ident, "OWNER": first.owner, "GRID3": lambda g: first.grid3(g, {}),
        "ARRAY": DeviceArray,
    }
    text = "\n".join(_launch_source(kernel, True, torch, env) + _launch_source(kernel, False, torch, env)) + "\n"
    exec(compile(text, f"<warploop launcher {kernel.name}>", "exec"), env)
    kernel.fast_source = text
    make_fixed, make_dynamic = env["make_fixed"], env["make_dynamic"]
    return lambda grid: make_dynamic(grid) if callable(grid) else make_fixed(grid)
