"""warploop: GPU-native Python.

Kernels written once in Triton are compiled ahead of time into bundles for every GPU family
(`warploop.export`, `warploop bundle build`, `warploop.load_bundle`); a resident GPU kernel runs
tasks that spawn, join and call back to the host (`warploop.Runtime`); an LLM engine runs on top.
Heavy modules load lazily: `import warploop` imports neither torch nor Triton.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "Target": "warploop.target",
    "DeviceInfo": "warploop.target",
    "probe_devices": "warploop.target",
    "select_device": "warploop.target",
    "export": "warploop.bundle.export",
    "load_bundle": "warploop.bundle.load",
    "Runtime": "warploop.runtime",
    "task": "warploop.runtime",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'warploop' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
