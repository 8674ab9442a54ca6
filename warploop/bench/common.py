"""What every benchmark shares: the header (device, date, versions) and result files.

Results of device runs are committed unedited as bench/results/<bench>-<device>-<YYYYMMDD>.json.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform

from warploop.target import select_device


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("warploop", "torch", "triton", "cuda-bindings", "transformers"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def device_slug() -> str:
    """Short device name for result file names: h100, h200, mi300x, ... or cpu."""
    info = select_device()
    if info.target.backend == "cpu":
        return "cpu"
    name = info.name.lower()
    for key in ("h100", "h200", "b200", "a100", "l40s", "mi300x", "mi250", "mi325"):
        if key in name:
            return key
    return str(info.target).replace(":", "")


def header(bench: str) -> dict:
    info = select_device()
    return {"bench": bench, "device": info.name if info.target.is_gpu else "cpu",
            "target": str(info.target), "date": datetime.date.today().isoformat(), "versions": versions()}


def result_path(bench: str, directory: str = "bench/results") -> str:
    stamp = datetime.date.today().strftime("%Y%m%d")
    return os.path.join(directory, f"{bench}-{device_slug()}-{stamp}.json")


def emit(data: dict, save_to: str | None = None) -> None:
    """Print the result as one JSON object; also write it to `save_to` if given."""
    text = json.dumps(data, indent=2, sort_keys=False)
    print(text)
    if save_to:
        _write(text, save_to)


def checkpoint(data: dict, save_to: str | None) -> None:
    """Write what a long bench has so far to `save_to`, marked "partial": true, so a run cut short (a
    timeout, a later model's crash) keeps the models it finished; emit overwrites it at the end."""
    if save_to:
        _write(json.dumps({**data, "partial": True}, indent=2, sort_keys=False), save_to)


def _write(text: str, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(text + "\n")
    os.replace(path + ".tmp", path)     # whole or not at all: a reader never sees half a file

