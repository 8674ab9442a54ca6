"""Where the engine's time goes with a backend, on any device: `Engine.generate` under cProfile.

    PYTHONPATH=$PWD python scripts/mk_engine_profile.py --model tiny --backend megakernel --tokens 64

Prints the second generate's ms/token and the resident kernel's relaunches during it, then the
engine loop thread's functions with the most own time over both runs (a wait shows up as the
function that polls). The loop runs under the profiler throughout, so its ms/token is slower
than the CLI's; the first run warms up (compile, CUDA graphs, first module loads).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

from warploop.llm import engine as engine_mod
from warploop.llm.build import build_engine
from warploop.llm.params import SamplingParams

PROFILE = cProfile.Profile()
_loop = engine_mod.Engine._loop


def _profiled_loop(self) -> None:
    """The engine's loop thread (where steps are launched and completed) under the profiler."""
    PROFILE.runcall(_loop, self)


engine_mod.Engine._loop = _profiled_loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--backend", default="megakernel", choices=["torch", "megakernel"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    engine = build_engine(args.model, backend=args.backend, max_num_seqs=4, progress=False)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    try:
        engine.generate("def main(", params)          # warm-up
        backend = getattr(engine.backend, "rt", None)
        before = getattr(getattr(backend, "_backend", None), "relaunches", 0)
        t0 = time.perf_counter()
        out = engine.generate("def main(", params)
        plain = (time.perf_counter() - t0) * 1e3
        relaunches = getattr(getattr(backend, "_backend", None), "relaunches", 0) - before
        print(f"{args.backend}: ms/token {out.ms_per_token:.3f}, generate {plain:.1f} ms for "
              f"{len(out.token_ids)} tokens, relaunches {relaunches}")
    finally:
        engine.close()
    s = io.StringIO()
    pstats.Stats(PROFILE, stream=s).sort_stats("tottime").print_stats(args.top)
    print("the loop thread, both generates:\n" + s.getvalue())


if __name__ == "__main__":
    main()
