"""TTFT of a long prompt on the megakernel backend against the per-op backend, in turn, on a GPU.

    PYTHONPATH=$PWD python scripts/ttft_ab.py --model llama-3.2-1b --rounds 10 \
        --engines torch megakernel 'megakernel:{"graph_rows": 0}'

`warploop bench decode` reports a median of 3 TTFTs per backend, taken one backend after the other;
across runs its figures moved by 1.5x (BENCHMARKS.md). This takes both engines over the same random
weights and alternates them, a fresh prompt each round, in two cases: the first token of a request
that arrives while nothing runs (the resident kernel parked itself long ago), and one that arrives
right after a decode (the resident kernel is running and must park before the prefill's kernels get
the SMs). Each engine's prefill is also timed inside the backend (forward_sample, synchronised;
for the megakernel the parking before it apart). Prints one JSON object: per engine and case, every
TTFT in ms and the median.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from warploop import config
from warploop.bench.decode import GPU_MODELS, _engine
from warploop.llm.params import SamplingParams
from warploop.llm.weights import random_weights


def instrument(engine) -> dict:
    """Time each long prefill inside the backend: [park ms], [prefill and sampling ms] (synchronised),
    and when it started and the engine's last decode loop ended (perf_counter s)."""
    backend = engine.backend
    times = {"park_ms": [], "prefill_ms": [], "prefill_at": [], "prefill_end_at": [], "loop_end_at": [],
             "complete_at": [], "completed_at": [], "parked_after_prefill": []}
    sample, park = backend.forward_sample, getattr(backend, "per_op_forward", None)

    def timed_sample(batch, seqs):
        if batch.is_decode or len(batch.token_ids) < 512:      # the long prompts' prefills only
            return sample(batch, seqs)
        # no synchronize before: it would wait for a running resident kernel to park on its own
        times["prefill_at"].append(time.perf_counter())
        t0 = time.perf_counter()
        out = sample(batch, seqs)
        torch.cuda.synchronize()
        times["prefill_ms"].append((time.perf_counter() - t0) * 1e3)
        times["prefill_end_at"].append(time.perf_counter())
        rts = getattr(backend, "runtimes", [])
        times["parked_after_prefill"].append([bool(rt._backend.parked()) for rt in rts])  # noqa: SLF001
        return out

    drive = engine._drive_loop  # noqa: SLF001

    def timed_drive(loop):
        ended = drive(loop)
        if ended:
            times["loop_end_at"].append(time.perf_counter())
        return ended

    engine._drive_loop = timed_drive  # noqa: SLF001
    complete = engine._complete  # noqa: SLF001

    def timed_complete(step):
        times["complete_at"].append(time.perf_counter())
        complete(step)
        times["completed_at"].append(time.perf_counter())

    engine._complete = timed_complete  # noqa: SLF001

    def timed_park(batch):
        t0 = time.perf_counter()
        for rt in backend.runtimes:
            rt.park()
        if len(batch.token_ids) >= 512:
            times["park_ms"].append((time.perf_counter() - t0) * 1e3)
        return backend.per_op.forward(batch)

    backend.forward_sample = timed_sample
    if park is not None:
        backend.per_op_forward = timed_park
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.2-1b", choices=list(GPU_MODELS))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--engines", nargs="+", default=["torch", "megakernel"],
                        help="backend names, a megakernel one optionally with WARPLOOP_MK_PLAN options: "
                             "'megakernel:{\"graph_rows\": 0}'")
    args = parser.parse_args()
    cfg = GPU_MODELS[args.model][1]
    weights = random_weights(cfg, "cuda", torch.bfloat16)
    engines, inside = {}, {}
    for spec in args.engines:
        name, _, plan = spec.partition(":")
        os.environ["WARPLOOP_MK_PLAN"] = plan or "{}"
        config.reload()
        engines[spec] = _engine(cfg, weights, torch.device("cuda"), name)
        inside[spec] = instrument(engines[spec])
    gen = torch.Generator().manual_seed(0)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    decode = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    def prompt(n):
        return torch.randint(1, cfg.vocab_size, (n,), generator=gen).tolist()

    out = {"model": args.model, "tokens": args.tokens, "device": torch.cuda.get_device_name(),
           "relaunches_before": {k: [rt._backend.relaunches for rt in e.backend.runtimes]  # noqa: SLF001
                                 for k, e in engines.items() if hasattr(e.backend, "runtimes")}}
    times = {(name, case): [] for name in engines for case in ("idle", "after_decode")}
    for engine in engines.values():            # warm: the prefill kernels of this length
        engine.generate(prompt(args.tokens), one)
    try:
        for _ in range(args.rounds):
            for name, engine in engines.items():
                time.sleep(0.05)               # past park_after_us: the resident kernel has parked
                times[(name, "idle")].append(engine.generate(prompt(args.tokens), one).ttft_ms)
                engine.generate(prompt(32), decode)
                t0 = time.perf_counter()
                times[(name, "after_decode")].append(engine.generate(prompt(args.tokens), one).ttft_ms)
                t = inside[name]
                if t["prefill_at"]:     # after the request: the loop's end and the prefill's start, ms
                    ends = [e for e in t["loop_end_at"] if e >= t0 - 0.1]
                    t.setdefault("after_decode_loop_end_ms", []).append(
                        (ends[-1] - t0) * 1e3 if ends else float("nan"))
                    t.setdefault("after_decode_prefill_start_ms", []).append((t["prefill_at"][-1] - t0) * 1e3)
                    t.setdefault("after_decode_prefill_end_ms", []).append((t["prefill_end_at"][-1] - t0) * 1e3)
                    t.setdefault("after_decode_complete_ms", []).append((t["complete_at"][-1] - t0) * 1e3)
                    t.setdefault("after_decode_completed_ms", []).append((t["completed_at"][-1] - t0) * 1e3)
        out["relaunches_after"] = {k: [rt._backend.relaunches for rt in e.backend.runtimes]  # noqa: SLF001
                                   for k, e in engines.items() if hasattr(e.backend, "runtimes")}
    finally:
        for engine in engines.values():
            engine.close()
    for (name, case), values in times.items():
        out[f"{name}_{case}_ms"] = [round(v, 3) for v in values]
        out[f"{name}_{case}_median_ms"] = round(statistics.median(values), 3)
    for name, t in inside.items():
        for key, values in t.items():
            if key.endswith("_at"):
                continue
            if key == "parked_after_prefill":
                out[f"{name}_{key}"] = values
                continue
            out[f"{name}_inside_{key}"] = [round(v, 3) for v in values]
            if values:
                out[f"{name}_inside_{key}_median"] = round(statistics.median(values), 3)
    if "torch" in engines:
        for name in engines:
            for case in ("idle", "after_decode"):
                out[f"{name}_over_torch_{case}"] = round(out[f"{name}_{case}_median_ms"]
                                                         / out[f"torch_{case}_median_ms"], 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
