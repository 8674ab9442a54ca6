"""Spills that wait, in the decode megakernel's SASS, without a GPU.

    PYTHONPATH=$PWD python scripts/mk_spills.py --model llama-3.2-1b [--plan '{}'] [--show 20]
    python scripts/mk_spills.py --cubin path/to/resident.cubin

One kernel holds every task at 255 registers, so ptxas spills. A spill is cheap when its store and
its reload hit L1 off the critical path, and costly in two patterns, which this counts:

- a load's register stored to the stack soon after the load (`STL` of a register an `LDG` wrote a
  few instructions before): the store waits for the load's data, so the thread stalls a whole
  round trip there (the instruction words loaded before each body did this: session 17);
- a reload from the stack soon after an acquire (`LDL` after `CCTL.IVALL`, which a counter wait's
  `ld.acquire` emits): on the node's path after its wait.

The counts are over the whole kernel, most of which runs rarely: they did not predict which of
session 16's plans ran faster (BENCHMARKS.md, Decode, session 17). Use --show and read where the
matches are: a match on every node's path (the dispatch, a tile before its weights) is the kind
that cost 5-12%.

The kernel is compiled as scripts/mk_resources.py compiles it (Triton's JIT warmup, for sm_90
through a stand-in driver when there is no GPU; a kernel already in Triton's cache is read from
it) and disassembled with the nvdisasm Triton ships. Prints one JSON object; --show lists the
first matches with the load each stalled store waits for.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

INSTR = re.compile(r"/\*([0-9a-f]+)\*/\s+(.*?)\s*;")


def tool(name: str) -> str:
    import triton.backends.nvidia as nv
    return os.path.join(os.path.dirname(nv.__file__), "bin", name)


def sass_of(cubin: str) -> list[tuple[int, str]]:
    """(address, instruction without its predicate) for every instruction of the cubin."""
    text = subprocess.run([tool("nvdisasm"), "-c", cubin], check=True, capture_output=True, text=True).stdout
    return [(int(m.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", m.group(2))) for m in INSTR.finditer(text)]


def usage(cubin: str) -> dict:
    out = subprocess.run([tool("cuobjdump"), "-res-usage", cubin], check=True, capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return {"registers": int(m.group(1)), "stack_bytes": int(m.group(2))} if m else {}


def width(op: str) -> int:
    return 4 if ".128" in op else 2 if ".64" in op else 1


def scan(ins: list[tuple[int, str]], window: int) -> dict:
    """Stalled spill stores and reloads after acquires, with examples."""
    loaded: dict[str, tuple[int, str]] = {}     # register -> (index, the LDG that wrote it)
    stalled, after_acquire = [], []
    last_ivall = -10 ** 9
    for i, (addr, body) in enumerate(ins):
        parts = body.split()
        if not parts:
            continue
        op = parts[0]
        if op.startswith("CCTL") and "IVALL" in op:
            last_ivall = i
        if op.startswith("STL"):
            m = re.search(r"\],\s*(R\d+)", body)
            if m and m.group(1) in loaded and i - loaded[m.group(1)][0] <= window:
                stalled.append((addr, body, loaded[m.group(1)][1]))
        elif op.startswith("LDL") and i - last_ivall <= window:
            after_acquire.append((addr, body, "after CCTL.IVALL"))
        dst = re.match(r"\S+\s+(R\d+)", body)
        if op.startswith("LDG") and dst:
            base = int(dst.group(1)[1:])
            for k in range(width(op)):
                loaded[f"R{base + k}"] = (i, body)
        elif dst and not op.startswith(("ST", "RED", "BAR", "BRA", "ATOM")):
            loaded.pop(dst.group(1), None)      # overwritten by anything but a load
    return {"instructions": len(ins), "STL": sum(b.startswith("STL") for _, b in ins),
            "LDL": sum(b.startswith("LDL") for _, b in ins),
            "stalled_spill_stores": stalled, "reloads_after_acquire": after_acquire}


def compiled_cubin(model: str, plan: str, path: str) -> None:
    """Compile (or find in Triton's cache) the model's resident kernel and write its cubin to path."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from mk_resources import compile_kernel, plan_of  # scripts/: beside this file

    from warploop.llm.shapes import CPU_MODELS, GPU_MODELS
    models = {**CPU_MODELS, **GPU_MODELS}
    if model not in models:
        sys.exit(f"--model {model}: not a bench model shape; use one of {', '.join(sorted(models))}")
    compiled_plan, warps, regs = plan_of(models[model][1], json.loads(plan))
    kernel = compile_kernel(compiled_plan, None, warps, max_registers=regs)
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.2-1b", help="a bench model shape (warploop bench decode's names)")
    ap.add_argument("--plan", default="{}", help="WARPLOOP_MK_PLAN-style JSON object")
    ap.add_argument("--cubin", default=None, help="disassemble this cubin instead of compiling")
    ap.add_argument("--window", type=int, default=40, help="instructions between the load (or acquire) and the spill")
    ap.add_argument("--show", type=int, default=0, help="list this many matches of each pattern")
    args = ap.parse_args()
    try:
        json.loads(args.plan)
    except json.JSONDecodeError as e:
        sys.exit(f"--plan: not a JSON object ({e}); e.g. --plan '{{\"tile_kb\": 64}}'")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = args.cubin
        if cubin is None:
            cubin = os.path.join(tmp, "resident.cubin")
            compiled_cubin(args.model, args.plan, cubin)
        elif not os.path.isfile(cubin):
            sys.exit(f"--cubin {cubin}: no such file")
        found = scan(sass_of(cubin), args.window)
        report = {"cubin": args.cubin or f"{args.model} {args.plan}", **usage(cubin),
                  **{k: len(v) if isinstance(v, list) else v for k, v in found.items()}}
    print(json.dumps(report))
    for key in ("stalled_spill_stores", "reloads_after_acquire"):
        for addr, body, why in found[key][:args.show]:
            print(f"{key}: {addr:#x} {body}   <- {why}")


if __name__ == "__main__":
    main()
