"""The generated fast path of a GPU kernel launch.

Per-launch Python work is what separates a launcher from a raw `cuLaunchKernel` call, so for each
kernel we generate one straight-line function (as Triton generates its C launcher): argument kinds,
dtypes, slot layout and driver handles are fixed at load time and bound as constants. It handles
the common call, `kernel[grid](tensors and scalars...)` with torch tensors on this device from the
loading thread; any other shape of call, and every argument that fails a check, goes to
`Kernel.general`, which does the same launch or raises the precise error. The source is kept as
`kernel.fast_source` for reading.
"""
from __future__ import annotations

import struct
import sys
import threading
from collections.abc import Callable
from typing import Any

from warploop.bundle.abi import POINTEE_DTYPES, pack_bf16


class _NeverATensor:
    """Stands in for torch.Tensor when torch is not loaded: every pointer argument takes the general path."""


def _spec_branch(k: int, spec: Any, torch: Any, lines: list[str], env: dict[str, Any]) -> None:
    conds = []
    for i, p in enumerate(spec.runtime):
        if p.is_pointer:
            # Without torch no argument passes the tensor check above, so the dtype is never compared.
            env[f"DT{k}_{i}"] = getattr(torch, POINTEE_DTYPES[p.type[1:]], None) if torch else None
            conds.append(f"a{i}.dtype is DT{k}_{i}")
        divisor = spec.spec.specialize.get(p.name)
        if divisor:
            mask = divisor - 1
            conds.append(f"not p{i} & {mask}" if p.is_pointer else f"type(a{i}) is int and not a{i} & {mask}")
    values = [f"p{i}" if p.is_pointer else f"BF16(a{i})" if p.type == "bf16" else f"a{i}"
              for i, p in enumerate(spec.runtime)]
    env.update({f"PACK{k}": spec.pack_into, f"BUF{k}": spec.buffer, f"PARAMS{k}": spec.params_address,
                f"FN{k}": spec.handle, f"BX{k}": spec.block, f"SH{k}": spec.variant.shared,
                f"LAUNCH{k}": spec.api, f"FAILED{k}": spec.failed, f"GRID{k}": _grid3_of(spec),
                f"SCRATCH{k}": spec.set_scratch})
    call = f"LAUNCH{k}(FN{k}, gx, gy, gz, BX{k}, 1, 1, SH{k}, s, PARAMS{k}, 0)"
    scratch = spec.variant.global_scratch_size or spec.variant.profile_scratch_size
    lines += [
        f"    if {' and '.join(conds) or 'True'}:",
        "        if type(grid) is tuple and len(grid) == 1:",
        "            gx = grid[0]; gy = gz = 1",
        "        else:",
        f"            gx, gy, gz = GRID{k}(grid, args)",
        "        try:",
        f"            PACK{k}(BUF{k}, 0, {', '.join(values)})",
        "        except STRUCT_ERROR:",
        "            return general(grid, *args, stream=stream)",
        "        s = CUR() if stream is None else AS_STREAM(stream)",
        *([f"        SCRATCH{k}(BUF{k}, gx * gy * gz, s)"] if scratch else []),
        f"        ret = {call}",
        "        if ret[0]:",
        f"            FAILED{k}(ret[0], gx * gy * gz, lambda: {call})",
        "        return",
    ]


def _grid3_of(spec: Any) -> Callable[[Any, tuple], tuple[int, int, int]]:
    names = [p.name for p in spec.runtime]
    return lambda grid, args: spec.grid3(grid, dict(zip(names, args, strict=True)))


def fast_launcher(kernel: Any) -> Callable[..., None]:
    """Generate, compile and return `launch(grid, *args, stream=None, **meta)` for a GPU kernel."""
    specs = kernel.specs
    first = specs[0]
    n = len(first.runtime)
    pointer_idx = [i for i, p in enumerate(first.runtime) if p.is_pointer]
    torch = sys.modules.get("torch")
    env: dict[str, Any] = {
        "general": kernel.general, "Tensor": torch.Tensor if torch else _NeverATensor,
        "DEV": first.driver.info.index, "CUR": first.current_stream, "AS_STREAM": first.driver.as_stream,
        "STRUCT_ERROR": struct.error, "BF16": pack_bf16, "IDENT": threading.get_ident, "OWNER": first.owner,
    }
    names = [f"a{i}" for i in range(n)]
    lines = [
        "def launch(grid, *args, stream=None, **meta):",
        f"    if meta or len(args) != {n} or IDENT() != OWNER:",
        "        return general(grid, *args, stream=stream, **meta)",
    ]
    if n:
        lines.append(f"    {', '.join(names)}{',' if n == 1 else ''} = args")
    if pointer_idx:
        checks = " or ".join(f"type(a{i}) is not Tensor or a{i}.get_device() != DEV" for i in pointer_idx)
        lines += [f"    if {checks}:", "        return general(grid, *args, stream=stream)"]
        lines += [f"    p{i} = a{i}.data_ptr()" for i in pointer_idx]
    for k, spec in enumerate(specs):
        if spec.spec.constexprs == kernel.default_constexprs:  # others need constexpr keywords: general path
            _spec_branch(k, spec, torch, lines, env)
    lines.append("    return general(grid, *args, stream=stream)")
    source = "\n".join(lines) + "\n"
    exec(compile(source, f"<warploop launcher {kernel.name}>", "exec"), env)
    kernel.fast_source = source
    return env["launch"]
