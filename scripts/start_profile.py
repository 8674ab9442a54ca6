"""Where an engine's start goes: the seconds of each phase of `Engine.from_model` on a checkpoint
(scripts/checkpoint.py's random weights), in one process, with the caches the caller set (empty
ones for a cold start: TRITON_CACHE_DIR, WARPLOOP_CACHE_DIR), and the functions that took longest
under cProfile. scripts/serve_cold.py times the whole `warploop serve` start; this says why.

    TRITON_CACHE_DIR=$(mktemp -d) WARPLOOP_CACHE_DIR=$(mktemp -d) \\
        python scripts/start_profile.py --model llama-3.2-1b [--top 40] > profile.json
"""
from __future__ import annotations

import time

T0 = time.monotonic()

import argparse  # noqa: E402
import cProfile  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pstats  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    from warploop.llm.shapes import CPU_MODELS, GPU_MODELS
    shapes = {**GPU_MODELS, **CPU_MODELS}
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.2-1b", choices=list(shapes))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "cold-models"))
    ap.add_argument("--top", type=int, default=40, help="the functions listed, by cumulative seconds")
    args = ap.parse_args()
    phases = {"python_and_argparse_s": time.monotonic() - T0}
    path = Path(args.dir) / args.model
    if not (path / "config.json").exists():
        from checkpoint import write_checkpoint
        write_checkpoint(path, shapes[args.model][1], "cuda" if args.device == "cuda" else "cpu")
    t = time.monotonic()
    import torch
    if args.device == "cuda":
        torch.cuda.init()
        torch.empty(1, device="cuda")
    phases["torch_and_cuda_s"] = time.monotonic() - t
    t = time.monotonic()
    from warploop.llm.engine import Engine
    from warploop.llm.params import SamplingParams
    phases["import_engine_s"] = time.monotonic() - t
    prof = cProfile.Profile()
    t = time.monotonic()
    prof.enable()
    engine = Engine.from_model(str(path), device=args.device)
    prof.disable()
    phases["engine_s"] = time.monotonic() - t
    t = time.monotonic()
    prof.enable()
    engine.generate(list(range(1, 9)), SamplingParams(max_tokens=2, temperature=0))
    prof.disable()
    phases["first_request_s"] = time.monotonic() - t
    engine.close() if hasattr(engine, "close") else None
    stats = pstats.Stats(prof)
    rows = sorted(((v[3], v[2], v[1], f"{Path(k[0]).name}:{k[1]}:{k[2]}") for k, v in stats.stats.items()),
                  reverse=True)[:args.top]
    print(json.dumps({"model": args.model, "phases": {k: round(v, 3) for k, v in phases.items()},
                      "top_cumulative": [{"cum_s": round(c, 3), "self_s": round(s, 3), "calls": n, "fn": f}
                                         for c, s, n, f in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
