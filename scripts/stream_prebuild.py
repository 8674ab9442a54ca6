"""Compile the streaming kernels a model shape needs, ahead of time, into a folder a server launches
them from with no compiler (WARPLOOP_STREAM_PREBUILT=FOLDER, runtime/stream/prebuilt.py).

No GPU is needed: each StreamConfig compiles for sm_90 here (a few seconds each). A shape's batch-1
kernel always; with --rows N, the batched kernel of WARPLOOP_STREAM_ROWS=N's decoder.

    PYTHONPATH=. python scripts/stream_prebuild.py FOLDER --models llama-3.2-1b,qwen3-0.6b,smollm2-135m
"""
import argparse
import sys
import time

from warploop.llm.shapes import GPU_MODELS
from warploop.llm.stream_step import BATCH_ROWS, batch_rows, stream_config
from warploop.runtime.stream.prebuilt import write_variant


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--models", default="llama-3.2-1b,qwen3-0.6b,smollm2-135m",
                    help=f"comma-separated model shapes, of: {', '.join(sorted(GPU_MODELS))}")
    ap.add_argument("--rows", type=int, default=0, help="also the batched kernel for WARPLOOP_STREAM_ROWS=N")
    ap.add_argument("--block-size", type=int, default=16, help="the KV cache's block size (the engine's default: 16)")
    args = ap.parse_args()
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


if __name__ == "__main__":
    sys.exit(main())
