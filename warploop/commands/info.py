"""`warploop info`: the devices warploop sees and the one it would select."""
from __future__ import annotations

import argparse
import json

from warploop.target import probe_devices, select_device


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def info() -> dict:
    selected = select_device()
    return {"devices": [d.to_dict() for d in probe_devices()], "selected": selected.target.to_dict()
            | {"name": selected.name, "target": str(selected.target)}}


def main(args: argparse.Namespace) -> int:
    data = info()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    for d in data["devices"]:
        mark = "*" if d["target"] == data["selected"]["target"] else " "
        extra = f"  {d['sm_count']} SMs, {d['shared_mem_optin'] // 1024} KiB smem, driver {d['driver_version']}" \
            if d["backend"] != "cpu" else ""
        print(f"{mark} {d['target']:<12} {d['name']}{extra}")
    return 0
