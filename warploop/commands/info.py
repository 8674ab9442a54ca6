"""`warploop info`: the devices warploop sees, the one it would select, and why."""
from __future__ import annotations

import argparse
import json
import os

from warploop.runtime.stream import prebuilt as stream_prebuilt
from warploop.target import DeviceNotFoundError, probe_devices, probe_notes, select_device


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def info() -> dict:
    """The `info --json` object. `selected` is null (and `error` says why) when WARPLOOP_DEVICE asks
    for a backend with no device here: info is the command that explains that, so it must not fail."""
    devices = probe_devices()
    data: dict = {"devices": [d.to_dict() for d in devices], "notes": probe_notes(), "prebuilt": prebuilt()}
    try:
        selected = select_device()
    except DeviceNotFoundError as e:
        return data | {"selected": None, "error": str(e)}
    data["selected"] = selected.target.to_dict() | {"name": selected.name, "target": str(selected.target),
                                                    "reason": _reason(selected.target.backend, devices)}
    return data


def prebuilt() -> list[dict]:
    """The kernels the package ships compiled (each with "kind", "target", "dtype", "head_dim" and
    "current": built from this warploop's sources). A shipped folder that cannot be read is listed
    as one entry with its "error": info must not fail."""
    from warploop.llm.ops_prebuilt import listing as ops_listing
    try:
        stream = stream_prebuilt.listing()
    except stream_prebuilt.PrebuiltError as e:
        stream = [{"kind": "stream", "error": str(e)}]
    try:
        ops = ops_listing()
    except Exception as e:          # a bundle that cannot be read: said, and info goes on
        ops = [{"kind": "ops", "error": f"{type(e).__name__}: {e}"}]
    return stream + ops


def _reason(backend: str, devices) -> str:
    forced = os.environ.get("WARPLOOP_DEVICE")
    if forced and forced != "auto":
        return f"WARPLOOP_DEVICE={forced}"
    if backend != "cpu":
        return "the first GPU found (set WARPLOOP_DEVICE=cpu|cuda|hip to choose)"
    return "no GPU found: the CPU executor runs everything"


def _size(n: int) -> str:
    return f"{n / 2**30:.0f} GiB" if n else "-"


def _driver(d: dict) -> str:
    v = d["driver_version"]
    if v is None:
        return "-"
    # CUDA encodes 13.0 as 13000; HIP's number is printed as the driver reports it.
    return f"CUDA {v // 1000}.{v % 1000 // 10}" if d["backend"] == "cuda" else str(v)


def main(args: argparse.Namespace) -> int:
    data = info()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0 if data["selected"] else 1
    rows = [("", "device", "target", "SMs", "memory", "smem/block", "driver")]
    chosen = data["selected"]["target"] if data["selected"] else None
    for d in data["devices"]:
        smem = f"{d['shared_mem_optin'] // 1024} KiB" if d["shared_mem_optin"] else "-"
        units = str(d["sm_count"]) if d["backend"] != "cpu" else f"{os.cpu_count()} cores"
        rows.append(("*" if d["target"] == chosen else "", d["name"], d["target"], units,
                     _size(d["total_memory"]), smem, _driver(d)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    for backend, note in data["notes"].items():
        print(f"{backend}: {note}")
    shipped = [p for p in data["prebuilt"] if "error" not in p and p["kind"] == "stream"]
    if shipped:
        shapes = "head_dim " + " and ".join(str(d) for d in sorted({p["head_dim"] for p in shipped}))
        stale = "" if all(p["current"] for p in shipped) else " (STALE: built from other sources, not used)"
        print(f"prebuilt: {len(shipped)} stream kernels ({', '.join(sorted({p['target'] for p in shipped}))}, "
              f"{shapes}){stale}; WARPLOOP_STREAM_PREBUILT=auto launches them")
    ops = [p for p in data["prebuilt"] if "error" not in p and p["kind"] == "ops"]
    if ops:
        stale = "" if all(p["current"] for p in ops) else " (STALE: built from other sources, not used)"
        print(f"prebuilt: {len({p['kernel'] for p in ops})} per-op kernels in {len(ops)} variants "
              f"({', '.join(sorted({p['target'] for p in ops}))}){stale}")
    if data["selected"] is None:
        print(f"selected: none. {data['error']}")
        return 1
    s = data["selected"]
    print(f"selected: {s['target']} ({s['name']}, warp size {s['warp_size']}): {s['reason']}")
    return 0
