"""Host calls for the tasks of a warploop.Runtime: its ports, server, files and buffers in one object.

    calls = HostCalls(files_root="data", read_only=True, functions={"square": square})
    with calls, warploop.Runtime(tasks=[work], ports=calls.ports) as rt:
        calls.bind(rt)                       # scan only the ports of rt's workers
        calls.register_buffer(buf)           # file calls may fill it
        rt.submit(work, buf, n).result()

    # in a task:  p = std.task_port(ctx)      # this worker's port (slot 0)
    #             std.print(p, FMT, x)
    #             h = wl.external(ctx)         # resumed by the reply, the worker moves on:
    #             std.call_async(std.task_port(ctx, 1), SQUARE, x, then=std.token(h))
    #             wl.then(ctx, h, on_square, h, out)   # on_square reads wl.result(ctx, h)

The Runtime learns its worker count only once it has sized the resident kernel, but the port array
must exist before (its address is in the kernel's arena header), so HostCalls allocates ports for
the most workers the device can hold and `bind` narrows the server's scan to the real ones.
Every worker gets SLOTS_PER_WORKER ports: slot 0 for synchronous calls, the others for async calls
in flight.
"""
from __future__ import annotations

import os
from collections.abc import Callable

from warploop.std.files import FileTable
from warploop.std.handlers import HostFunction
from warploop.std.memory import Buffers
from warploop.std.protocol import SLOTS_PER_WORKER, allocate_ports
from warploop.std.server import HostServer

MAX_PROGRAMS_PER_SM = 32     # the most resident programs an SM holds (64 warps of 1-warp programs)
CPU_MAX_WORKERS = 64


def max_workers_of(device=None) -> int:
    """An upper bound on the runtime's workers for `device` (None: the one warploop would pick)."""
    from warploop.target import select_device

    info = select_device(device)
    return info.sm_count * MAX_PROGRAMS_PER_SM if info.target.is_gpu else CPU_MAX_WORKERS


class HostCalls:
    """Everything that answers warploop.std calls from a runtime's tasks (see the module docstring)."""

    def __init__(self, *, files_root: str | os.PathLike | None = None, read_only: bool = False,
                 functions: dict[str, Callable | HostFunction] | None = None, max_workers: int | None = None,
                 device=None, out=None, pool_workers: int = 8) -> None:
        import torch

        self.max_workers = max_workers or max_workers_of(device)
        self.ports = allocate_ports(self.max_workers, SLOTS_PER_WORKER, pinned=torch.cuda.is_available())
        self.server = HostServer(self.ports, files=FileTable(files_root, read_only), buffers=Buffers(),
                                 functions=functions, out=out, pool_workers=pool_workers)

    def bind(self, runtime) -> None:
        """Serve only the ports of `runtime`'s workers (its worker count is known once it started),
        and resume its continuations: the reply to a call posted with then=std.token(h) completes
        the external handle h (wl.external) with the reply's status and result."""
        if runtime.workers > self.max_workers:
            raise ValueError(f"the runtime has {runtime.workers} workers but ports exist for {self.max_workers}; "
                             f"pass HostCalls(max_workers={runtime.workers})")
        self.server.watch(runtime.workers * SLOTS_PER_WORKER)
        self.server.on_reply = lambda port, then, status, result: runtime.complete_external(then - 1, status, result)

    def register_function(self, name: str, fn: Callable, *, inline: bool = False, vectorized: bool = False) -> int:
        """Make `fn` callable from tasks: std.call(port, <returned id>, ...)."""
        return self.server.register_function(name, fn, inline=inline, vectorized=vectorized)

    def register_buffer(self, tensor) -> None:
        """Let file calls read into and write from `tensor`."""
        self.server.buffers.register(tensor)

    def start(self) -> HostCalls:
        self.server.start()
        return self

    def close(self) -> None:
        self.server.stop()

    def __enter__(self) -> HostCalls:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
