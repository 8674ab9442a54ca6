"""Probe: what one dependent stage costs under two ways of handing data across SMs.

A chain of STAGES stages, each FAN tiles of 32 outputs on FAN different CTAs (tile t of stage i on
CTA (i * FAN + t) % CTAS, one persistent kernel of CTAS CTAs); every tile of stage i reads all FAN x
32 outputs of stage i - 1 and writes its own 32 (their sum plus its row, so a wrong read shows).

- counter: the streaming kernel's way. The tile stores its outputs, then a GPU-scope release add
  on stage i's counter; a reader polls the counter with acquire loads until it holds FAN, then
  loads the outputs from L2 (.cg).
- flag: each output is stored with its stage's tag in one 8-byte word (tag << 32 | fp32 bits,
  single-copy atomic); a reader polls the outputs themselves (volatile loads, so L2) until every
  word carries the tag it expects. No counter, no fence, no second round trip.

Every poll is bounded: a wait that spins past SPIN polls records the stage in err and the kernel
ends. Prints one JSON object: µs a stage for each way (median of RUNS launches, CUDA events), and
the check of the last stage's outputs against the same chain on the host.

    PYTHONPATH=. python scripts/probe_stage_sync.py --stages 512 --fan 1,8,64
"""
# ruff: noqa: B023  (each run function is called inside its own loop iteration)
import argparse
import json
import statistics

import torch
import triton
import triton.language as tl

SPIN = 1 << 22


@triton.jit
def chain_counter(vals, counters, err, STAGES: tl.constexpr, FAN: tl.constexpr, CTAS: tl.constexpr,
                  SPIN: tl.constexpr):
    cta = tl.program_id(0)
    r = tl.arange(0, 32)
    src = tl.arange(0, FAN * 32)
    j = cta
    while j < STAGES * FAN:            # tile j % FAN of stage j // FAN
        i = j // FAN
        t = j % FAN
        acc = tl.zeros([32], tl.float32)
        if i > 0:
            polls = 0
            cnt = tl.atomic_add(counters + i - 1, 0, sem="acquire", scope="gpu")
            while (cnt < FAN) & (polls < SPIN):
                cnt = tl.atomic_add(counters + i - 1, 0, sem="acquire", scope="gpu")
                polls += 1
            if cnt < FAN:
                tl.store(err, i)
            x = tl.load(vals + (i - 1) * FAN * 32 + src, cache_modifier=".cg")
            acc += tl.sum(x, axis=0)
        y = acc * 0.5 + (r + t).to(tl.float32)
        tl.store(vals + i * FAN * 32 + t * 32 + r, y)
        tl.debug_barrier()
        tl.atomic_add(counters + i, 1, sem="release", scope="gpu")
        j += CTAS


@triton.jit
def chain_flag(words, err, tag0, STAGES: tl.constexpr, FAN: tl.constexpr, CTAS: tl.constexpr, SPIN: tl.constexpr):
    cta = tl.program_id(0)
    r = tl.arange(0, 32)
    src = tl.arange(0, FAN * 32)
    j = cta
    while j < STAGES * FAN:
        i = j // FAN
        t = j % FAN
        acc = tl.zeros([32], tl.float32)
        if i > 0:
            want = (tag0 + i - 1).to(tl.int64)
            polls = 0
            w = tl.load(words + (i - 1) * FAN * 32 + src, volatile=True)
            while (tl.min((w >> 32) == want, axis=0) == 0) & (polls < SPIN):
                w = tl.load(words + (i - 1) * FAN * 32 + src, volatile=True)
                polls += 1
            if tl.min((w >> 32) == want, axis=0) == 0:
                tl.store(err, i)
            x = (w & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
            acc += tl.sum(x, axis=0)
        y = acc * 0.5 + (r + t).to(tl.float32)
        bits = y.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        tl.store(words + i * FAN * 32 + t * 32 + r, ((tag0 + i).to(tl.int64) << 32) | bits)
        j += CTAS


def host_chain(stages: int, fan: int) -> torch.Tensor:
    r = torch.arange(32, dtype=torch.float64)
    prev = None
    for _ in range(stages):
        s = 0.0 if prev is None else float(prev.sum())
        prev = torch.stack([s * 0.5 + r + t for t in range(fan)])
    return prev.reshape(-1)


def time_ms(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=512)
    ap.add_argument("--fan", default="1,8,64", help="tiles a stage, comma-separated")
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    ctas = torch.cuda.get_device_properties(dev).multi_processor_count
    out = {"device": torch.cuda.get_device_name(dev), "triton": triton.__version__, "stages": args.stages,
           "ctas": ctas, "fan": {}}
    for fan in [int(f) for f in args.fan.split(",")]:
        n = args.stages * fan * 32
        want = host_chain(args.stages, fan).float()
        rec = {}
        vals = torch.zeros(n, device=dev)
        counters = torch.zeros(args.stages, dtype=torch.int32, device=dev)
        err = torch.zeros(1, dtype=torch.int32, device=dev)
        grid = (min(ctas, args.stages * fan),)

        def run_counter():
            counters.zero_()
            chain_counter[grid](vals, counters, err, args.stages, fan, grid[0], SPIN, num_warps=4)
        run_counter()
        torch.cuda.synchronize()
        ok = int(err.item()) == 0 and torch.allclose(vals[-fan * 32:].double().cpu(), want.double(), rtol=1e-4)
        ms = time_ms(run_counter, args.runs)
        rec["counter"] = {"us_per_stage": round(ms * 1e3 / args.stages, 3), "check": "ok" if ok else "FAILED"}
        words = torch.zeros(n, dtype=torch.int64, device=dev)
        err.zero_()
        runs = [0]

        def run_flag():
            runs[0] += 1      # each launch's tags are new, so no reset: a stale word never matches
            chain_flag[grid](words, err, runs[0] * args.stages, args.stages, fan, grid[0], SPIN, num_warps=4)
        run_flag()
        torch.cuda.synchronize()
        got = (words[-fan * 32:] & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
        ok = int(err.item()) == 0 and torch.allclose(got.double().cpu(), want.double(), rtol=1e-4)
        ms = time_ms(run_flag, args.runs)
        rec["flag"] = {"us_per_stage": round(ms * 1e3 / args.stages, 3), "check": "ok" if ok else "FAILED"}
        out["fan"][fan] = rec
        print(json.dumps({fan: rec}), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
