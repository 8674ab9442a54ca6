"""
Bundles: compile once for every GPU, run anywhere
=================================================

A Triton kernel is normally compiled the first time it is called, on the machine that calls it:
minutes of start-up for a large model, and a compiler on every production machine. A warploop
bundle moves that work to build time. This tutorial goes through the four steps:

1. export a kernel (examples/kernels.py shows twelve),
2. build a bundle for several GPU families, on a machine that may have no GPU,
3. load it: warploop probes the device and picks the matching variant,
4. launch it and check the result against torch.

Run it with `python examples/bundle_demo.py`; on a machine without a GPU it runs on the CPU
executor (Triton's interpreter), the same code path a CPU-only user of your bundle gets.
"""
import os
import sys
import tempfile
from pathlib import Path

import torch

import warploop
from warploop.bundle.build import build_bundle
from warploop.bundle.cli import describe
from warploop.bundle.format import BundleFile

HERE = Path(__file__).resolve().parent

# %%
# Step 1 - export
# ---------------
# `examples/kernels.py` decorates ordinary Triton kernels, for instance::
#
#     @warploop.export(signature={"x": "*fp32", "y": "*fp32", "out": "*fp32", "n": "i32"},
#                      constexprs={"BLOCK": 1024})
#     @triton.jit
#     def add(x, y, out, n, BLOCK: tl.constexpr): ...
#
# The signature uses Triton's own type strings. Stacking a second `export` adds a specialization:
# `add` has one that promises 16-byte aligned pointers, which lets Triton emit 128-bit loads.

# %%
# Step 2 - build
# --------------
# The same as `warploop bundle build examples/kernels.py -t cuda:90 -t hip:gfx942 -t cpu -o OUT.wlb`.
# No GPU is needed: Triton compiles for any target from any machine. We compile three kernels to
# keep the demo quick; the cpu "variant" is the source file itself, for the interpreter.


def build(directory: str) -> str:
    path = os.path.join(directory, "demo.wlb")
    build_bundle(HERE / "kernels.py", ["cuda:90", "hip:gfx942", "cpu"], path, progress=False,
                 only=["add", "softmax", "matmul"])
    return path


# %%
# Step 3 - inspect and load
# -------------------------
# `warploop bundle inspect OUT.wlb` lists what is inside; `load_bundle` checks every hash it uses,
# picks a variant per kernel (exact GPU arch, then compatible cubin, then PTX, then CPU) and loads
# it through the vendor driver. Triton is not imported on the GPU path.


def load(path: str) -> "warploop.bundle.load.Bundle":
    for kernel in describe(BundleFile(path))["kernels"]:
        print(f"  {kernel['name']:<8} " + ", ".join(f"{v['target']} ({'+'.join(v['formats'])})"
                                                      for v in kernel["variants"]))
    bundle = warploop.load_bundle(path)
    print(f"loaded on {bundle.device.target}: {bundle.chosen()['add'][0]}")
    return bundle


# %%
# Step 4 - run and check
# ----------------------
# Kernels are attributes, launched like Triton kernels: `bundle.add[grid](x, y, out, n)`. The grid
# is a tuple or a callable of the meta dict (the constexprs included). Arguments are checked
# before launch: count, dtype, device and alignment promises, each with an error that names the fix.


def run(bundle) -> float:
    device = "cpu" if bundle.device.target.backend == "cpu" else "cuda"
    x, y = torch.randn(3000, device=device), torch.randn(3000, device=device)
    out = torch.empty_like(x)
    bundle.add[lambda meta: (triton_cdiv(3000, meta["BLOCK"]),)](x, y, out, 3000)
    worst = float((out - (x + y)).abs().max())

    rows = torch.randn(4, 700, device=device)
    probs = torch.empty_like(rows)
    bundle.softmax[(4,)](rows, probs, 700, 700)
    worst = max(worst, float((probs - torch.softmax(rows, dim=1)).abs().max()))

    a = torch.randn(80, 48, device=device, dtype=torch.float16)
    b = torch.randn(48, 72, device=device, dtype=torch.float16)
    c = torch.empty(80, 72, device=device)
    bundle.matmul[lambda meta: (triton_cdiv(80, meta["BM"]), triton_cdiv(72, meta["BN"]))](a, b, c, 80, 72, 48)
    worst = max(worst, float((c - a.float() @ b.float()).abs().max()))
    return worst


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        path = build(tmp)
        print(f"built {path}: {os.path.getsize(path) / 1e3:.0f} kB")
        worst = run(load(path))
    print(f"largest difference from torch: {worst:.2e}")
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
