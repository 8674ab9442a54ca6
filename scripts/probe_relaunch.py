"""Park and relaunch the resident kernel many times and count the relaunches it did not survive.

    PYTHONPATH=$PWD python scripts/probe_relaunch.py --cycles 400 [--workers fill]

Each cycle: submit a task, take its result, then wait until the kernel has parked (park_after_us=0),
so the next submit relaunches it. A relaunch the kernel does not survive shows as a RuntimeFault
("exited while the runtime was open") or a timeout; the runtime is then reopened and the count goes on.
Prints one JSON object: cycles, faults, relaunches, the first fault's message.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.language as tl

import warploop


@warploop.task(signature={"x": "*i32"})
@triton.jit
def bump(x):
    tl.atomic_add(x, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--workers", default=None, help="Runtime(workers=...): a number or 'fill'")
    args = parser.parse_args()
    workers = None if args.workers is None else (args.workers if args.workers == "fill" else int(args.workers))
    x = torch.zeros(1, dtype=torch.int32, device="cuda")
    faults, first, relaunches, done = 0, None, 0, 0
    t0 = time.perf_counter()
    rt = warploop.Runtime(tasks=[bump], park_after_us=0, timeout=20, workers=workers)
    while done < args.cycles:
        try:
            rt.submit(bump, x).result(timeout=10)
            deadline = time.perf_counter() + 1.0
            while not rt._backend.parked() and time.perf_counter() < deadline:
                time.sleep(2e-5)
            done += 1
        except Exception as e:      # noqa: BLE001 - counted and reported
            faults += 1
            done += 1
            first = first or f"{type(e).__name__}: {e}"[:600]
            relaunches += rt._backend.relaunches
            try:
                rt.close(timeout=2)
            except Exception:       # noqa: BLE001 - the runtime is being replaced
                pass
            rt = warploop.Runtime(tasks=[bump], park_after_us=0, timeout=20, workers=workers)
    relaunches += rt._backend.relaunches
    rt.close(timeout=10)
    print(json.dumps({"cycles": args.cycles,
                      "faults": faults, "relaunches": relaunches, "bumps": int(x.item()),
                      "s": round(time.perf_counter() - t0, 1), "first_fault": first}))


if __name__ == "__main__":
    main()
