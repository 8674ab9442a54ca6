"""Compile the streaming kernels a model shape needs, ahead of time, into a folder a server launches
them from with no compiler (WARPLOOP_STREAM_PREBUILT=FOLDER, runtime/stream/prebuilt.py).

No GPU is needed: each StreamConfig compiles for sm_90 here (a few seconds each). A shape's batch-1
kernel always; with --rows N, the batched kernel of WARPLOOP_STREAM_ROWS=N's decoder.

    PYTHONPATH=. python scripts/stream_prebuild.py FOLDER --models llama-3.2-1b,qwen3-0.6b,smollm2-135m

--shipped rewrites the package's own folder (runtime/stream/shipped) with every kernel of
stream_shipped.SHIPPED_KERNELS. Run it after any change to the kernel's sources, with the Triton the
GPU machines run (3.6.0: the cubins then need no newer driver than theirs); a test fails until then.

    PYTHONPATH=. /path/to/triton-3.6-venv/bin/python scripts/stream_prebuild.py --shipped
"""
import argparse
import shutil
import sys
import time

from warploop.llm.shapes import GPU_MODELS
from warploop.llm.stream_shipped import SHIPPED_ARCH, SHIPPED_KERNELS, shipped_configs
from warploop.llm.stream_step import BATCH_ROWS, batch_rows, stream_config
from warploop.runtime.stream.prebuilt import SHIPPED, write_variant


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", nargs="?", help="where to write the kernels (not with --shipped)")
    ap.add_argument("--shipped", action="store_true",
                    help=f"rewrite the package's shipped kernels ({SHIPPED}) from stream_shipped.SHIPPED_KERNELS")
    ap.add_argument("--models", default="llama-3.2-1b,qwen3-0.6b,smollm2-135m",
                    help=f"comma-separated model shapes, of: {', '.join(sorted(GPU_MODELS))}")
    ap.add_argument("--rows", type=int, default=0, help="also the batched kernel for WARPLOOP_STREAM_ROWS=N")
    ap.add_argument("--block-size", type=int, default=16, help="the KV cache's block size (the engine's default: 16)")
    args = ap.parse_args()
    if args.shipped:
        if args.folder:
            ap.error("--shipped writes the package's own folder: give no FOLDER with it")
        return shipped()
    if not args.folder:
        ap.error("give the FOLDER to write the kernels into (or --shipped)")
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in GPU_MODELS]
    if unknown:
        ap.error(f"--models: no shape {', '.join(unknown)}; use {', '.join(sorted(GPU_MODELS))}")
    if args.rows < 0 or args.rows == 1 or args.rows > BATCH_ROWS[-1]:
        ap.error(f"--rows {args.rows}: use 0 or 2 to {BATCH_ROWS[-1]}")
    rows = [0] + ([batch_rows(args.rows)] if args.rows else [])     # the one batched decoder of that many rows
    configs = {}
    for m in models:
        for r in rows:
            configs.setdefault(stream_config(GPU_MODELS[m][1], batch_rows=r), []).append(f"{m}/{r or 1}")
    for i, (cfg, users) in enumerate(configs.items()):
        t = time.time()
        key = write_variant(cfg, args.folder, arch=90, block_size=args.block_size)
        print(f"[{i + 1}/{len(configs)}] {key} for {', '.join(users)}: {time.time() - t:.1f} s", file=sys.stderr)
    return 0


def shipped() -> int:
    import triton
    if triton.__version__ != "3.6.0":
        print(f"warning: Triton {triton.__version__} builds these; the GPU machines run 3.6.0, whose cubins need "
              "no newer driver than theirs", file=sys.stderr)
    shutil.rmtree(SHIPPED, ignore_errors=True)
    configs = shipped_configs()
    for i, (cfg, users) in enumerate(zip(configs, SHIPPED_KERNELS.values(), strict=True)):
        t = time.time()
        key = write_variant(cfg, SHIPPED, arch=SHIPPED_ARCH)
        print(f"[{i + 1}/{len(configs)}] {key} for {users}: {time.time() - t:.1f} s", file=sys.stderr)
    size = sum(f.stat().st_size for f in SHIPPED.iterdir())
    print(f"wrote {SHIPPED}: {len(configs)} kernels, {size / 1e6:.1f} MB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
