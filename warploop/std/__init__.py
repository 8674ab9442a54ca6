"""The standard library on the GPU: tasks print, read clocks, read and write files and call host
Python functions through mailboxes ("ports") in pinned host memory, answered by a host server.

    warploop.std.device     the Triton functions device code calls (print, clock, time, open, read,
                            write, close, call, and their async forms)
    warploop.std.server     HostServer: the host thread that answers them
    warploop.std.dispatch   one pass of that thread: batching, the pool, replies, errors
    warploop.std.handlers   what each request does on the host
    warploop.std.runtime    HostCalls: ports, server, files and buffers for a warploop.Runtime
    warploop.std.protocol   the port layout, opcodes and statuses (documented in docs/std.md)
    warploop.std.files      FileTable: file calls confined to one root directory
    warploop.std.memory     Buffers: the device buffers file calls may fill or drain
    warploop.std.strings    intern(): ids for format strings, paths and function names

Importing this package needs neither torch nor Triton; `warploop.std.device` needs Triton.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "HostServer": "warploop.std.server",
    "HostCalls": "warploop.std.runtime",
    "HostFunction": "warploop.std.handlers",
    "FileTable": "warploop.std.files",
    "Buffers": "warploop.std.memory",
    "allocate_ports": "warploop.std.protocol",
    "intern": "warploop.std.strings",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'warploop.std' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
