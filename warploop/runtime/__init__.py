"""The resident runtime: one persistent GPU kernel that runs tasks written in Triton.

`task` registers a Triton device function as a task; `Runtime` starts the resident kernel (or
the CPU executor) and takes work through host memory; `device` (imported as `wl` in task code)
is what task bodies call: spawn, join, then, wait. docs/runtime.md describes the layouts.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "Runtime": "warploop.runtime.host",
    "Future": "warploop.runtime.host",
    "GraphFuture": "warploop.runtime.host",
    "Graph": "warploop.runtime.graph",
    "task": "warploop.runtime.tasks",
    "Task": "warploop.runtime.tasks",
    "TaskDescriptor": "warploop.runtime.descriptor",
    "TaskError": "warploop.runtime.errors",
    "RuntimeFault": "warploop.runtime.errors",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'warploop.runtime' has no attribute {name!r}")
