"""Rebuild warploop/llm/shipped/ops.wlb, the per-op GPU kernels the package ships compiled, from
warploop/llm/ops_kernels.py. No GPU is needed; about a minute on two cores.

    PYTHONPATH=. python scripts/ops_bundle.py          # with Triton 3.6.0

Triton 3.6.0, because its ptxas (CUDA 12.8) makes cubins that any CUDA 12 or 13 driver loads; a
newer Triton's may need a newer driver than a server has (docs/bundle-format.md), so another version
is refused unless --any-triton. Two things are left out of the file, which would otherwise be
three times larger (7.5 MB): line info (TRITON_DISABLE_LINE_INFO), which maps machine code to source
lines for profilers (without it ptxas emitted the same instructions for 108 of the 110 variants and
scheduled the other two, decode_split_kernel at head dim 128 in half precision for sm_90a,
differently: the same operations in another order), and the PTX of sm_90a, which only a 9.0 GPU may
load and which needs a newer driver (CUDA 12.8) than the cubin beside it (12.0), so it is never the
one loaded.
"""
import argparse
import dataclasses
import os
import sys
from pathlib import Path

os.environ["TRITON_DISABLE_LINE_INFO"] = "1"     # before Triton is imported: the compile workers inherit it

from warploop.bundle.build import build_bundle  # noqa: E402
from warploop.bundle.format import BundleFile, write_bundle  # noqa: E402
from warploop.llm.ops_prebuilt import KERNELS, SHIPPED, TARGETS  # noqa: E402

TRITON = "3.6.0"


def drop_arch_specific_ptx(path: Path) -> None:
    """Rewrite the bundle at `path` without the PTX of arch-specific variants (sm_90a)."""
    bundle = BundleFile(path)
    kernels, blobs = [], {}
    for kernel in bundle.manifest.kernels:
        specs = []
        for s in kernel.specializations:
            variants = []
            for v in s.variants:
                formats = {f: d for f, d in v.formats.items() if not (f == "ptx" and v.arch_specific)}
                blobs.update({d: bundle.blob(d) for d in formats.values()})
                variants.append(dataclasses.replace(v, formats=formats))
            specs.append(dataclasses.replace(s, variants=tuple(variants)))
        kernels.append(dataclasses.replace(kernel, specializations=tuple(specs)))
    write_bundle(path, kernels, bundle.manifest.build, blobs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", default=str(SHIPPED), help=f"default: {SHIPPED}")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: WARPLOOP_JOBS, else all cores)")
    ap.add_argument("--any-triton", action="store_true", help=f"build with a Triton other than {TRITON}")
    args = ap.parse_args()
    import triton

    if triton.__version__ != TRITON and not args.any_triton:
        ap.error(f"Triton {triton.__version__} is installed; the shipped bundle is built with Triton {TRITON} "
                 f"(pip install triton=={TRITON} in a virtual environment), or pass --any-triton")
    build_bundle(KERNELS, list(TARGETS), args.output, jobs=args.jobs)
    drop_arch_specific_ptx(Path(args.output))
    print(f"wrote {args.output}: {os.path.getsize(args.output) / 1e6:.2f} MB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
