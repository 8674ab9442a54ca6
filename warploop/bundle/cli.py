"""`warploop bundle build FILE.py -t TARGET ... -o OUT.wlb` and `warploop bundle inspect OUT.wlb [--json]`."""
from __future__ import annotations

import argparse
import json
import os
import sys

from warploop.args import positive_int
from warploop.bundle.format import BundleFile, BundleFormatError

FORMAT_ORDER = ("cubin", "ptx", "hsaco", "source")


def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    from warploop.bundle.build import BUILD_TARGETS

    parser.add_argument("file", help="Python file whose @warploop.export kernels are compiled")
    parser.add_argument("-t", "--target", action="append", required=True, dest="targets",
                        help=f"target to compile for; repeat it (any of {', '.join(BUILD_TARGETS)})")
    parser.add_argument("-o", "--output", required=True, help="bundle file to write (.wlb)")
    parser.add_argument("-k", "--kernel", action="append", dest="kernels",
                        help="compile only this exported kernel; repeat it (default: all)")
    parser.add_argument("-j", "--jobs", type=positive_int, default=None,
                        help="parallel compile jobs (default: WARPLOOP_JOBS)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def main_build(args: argparse.Namespace) -> int:
    from warploop.bundle.build import BuildError, build_bundle, build_target

    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(folder):
        print(f"warploop bundle build: error: -o {args.output}: folder {folder} does not exist; create it first",
              file=sys.stderr)
        return 2
    for text in args.targets:
        try:
            build_target(text)
        except BuildError as e:
            print(f"warploop bundle build: error: -t {text}: {e}", file=sys.stderr)
            return 2
    try:
        manifest = build_bundle(args.file, args.targets, args.output, jobs=args.jobs, progress=not args.quiet,
                                only=args.kernels)
    except (BuildError, ValueError) as e:
        print(f"warploop bundle build: error: {e}", file=sys.stderr)
        return 1
    variants = [v for k in manifest.kernels for s in k.specializations for v in s.variants]
    cpu = sum(v.target == "cpu" for v in variants)
    print(f"wrote {args.output}: {len(manifest.kernels)} kernels, {len(variants)} variants "
          f"({len(variants) - cpu} compiled" + (f" + {cpu} cpu source" if cpu else "") + "), "
          f"{os.path.getsize(args.output) / 1e6:.2f} MB", file=sys.stderr)
    return 0


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle", help="bundle file (.wlb)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def describe(bundle: BundleFile) -> dict:
    """Kernels and their variants, per target (the `bundle inspect --json` contract), with details."""
    m = bundle.manifest
    kernels = []
    for k in m.kernels:
        by_target: dict[str, dict] = {}
        for s in k.specializations:
            for v in s.variants:
                entry = by_target.setdefault(v.target, {"target": v.target, "formats": [], "arch": v.arch,
                                                        "specializations": []})
                entry["formats"] = [f for f in FORMAT_ORDER if f in v.formats or f in entry["formats"]]
                entry["specializations"].append({
                    "spec": s.spec.label(), "num_warps": v.num_warps, "num_ctas": v.num_ctas, "shared": v.shared,
                    "global_scratch_size": v.global_scratch_size, "cooperative": v.cooperative, "pdl": v.pdl,
                    "bytes": {f: m.blobs[d]["size"] for f, d in v.formats.items()}})
        kernels.append({"name": k.name, "arg_names": list(k.arg_names),
                        "specializations": [{"label": s.spec.label(), **s.spec.to_dict()} for s in k.specializations],
                        "variants": list(by_target.values())})
    return {"path": bundle.path, "format_version": bundle.header.version, "build": m.build, "verified": True,
            "size": len(bundle.data), "kernels": kernels, "python_kernels": m.python_kernels()}


def main_inspect(args: argparse.Namespace) -> int:
    try:
        bundle = BundleFile(args.bundle)
        bundle.verify()
    except (BundleFormatError, OSError) as e:
        print(f"warploop bundle inspect: error: {e}", file=sys.stderr)
        return 1
    data = describe(bundle)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    b = data["build"]
    print(f"{args.bundle}: format v{data['format_version']}, {data['size'] / 1e6:.2f} MB, all hashes verified")
    print(f"  built {b.get('date')} from {b.get('source')} with triton {b.get('versions', {}).get('triton')}")
    if data["python_kernels"]:
        print(f"  a bundle is code: the cpu variant of {', '.join(data['python_kernels'])} is Python source that "
              f"loading on the CPU runs; load_bundle(..., allow_python=False) loads GPU variants only")
    for k in data["kernels"]:
        print(f"{k['name']}({', '.join(k['arg_names'])})")
        for v in k["variants"]:
            specs = "; ".join(f"[{s['spec']}] smem {s['shared']}" for s in v["specializations"])
            print(f"  {v['target']:<12} {'+'.join(v['formats']):<11} {v['arch']:<8} {specs}")
    return 0
