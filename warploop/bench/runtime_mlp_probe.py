"""Where the MLP stack's time goes: per-tile stamps, and a hand-written persistent peer.

`python -m warploop.bench.runtime_mlp_probe --out F.json` (CUDA only) runs, in one process:

* `persistent`: the stack's tiles in one ordinary persistent Triton kernel (no runtime): program t
  runs tile t of every GEMV, separated by a plain counter per GEMV (256 release atomics, one
  polling thread per program). The same tile body as the runtime's `worker_tile_ahead2`, so its
  time is what the body and the boundary cost without the runtime's worker loop around them; with
  `sync=False` the counters are skipped (wrong output: the bandwidth of the bodies alone).
* the runtime's `worker_tile_ahead2` graph with every tile stamped (entry, wait done, end, SM id).

From the stamps, per GEMV boundary: the tail (last tile end minus median tile end), the detection
delay (median wait-done of the next GEMV minus the last end of this one) and the tile body time
(end minus wait done); per worker, the SM it ran on. These say whether a boundary costs its slowest
tile, its signal, or its pipeline refill, and whether some workers are slower than others.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import triton
import triton.language as tl

import warploop
from warploop.bench.runtime_kernels import gemv_rows_unrolled
from warploop.bench.runtime_mlp_tasks import DOWN_W, DOWN_WE, DOWN_WR, MLP_SIG, UP_W, UP_WE, UP_WR
from warploop.runtime import layout as L

TILES = tl.constexpr(256)
STAMP_SIG = {**MLP_SIG, "stamps": "*i64"}


@warploop.task(signature=STAMP_SIG, constexprs=UP_W, waits=True, cost=1.0)
@triton.jit
def mlp_up_stamped(ctx, w, x, y, k, row0, pf, pf_n, stamps, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
                   AHEAD: tl.constexpr, BACKEND: tl.constexpr):
    gemv_rows_unrolled(w, x, y, k, row0, BN, BK, K, AHEAD, True, ctx, 1, BACKEND, stamps=stamps, STAMP=True)


@warploop.task(signature=STAMP_SIG, constexprs=DOWN_W, waits=True, cost=1.0)
@triton.jit
def mlp_down_stamped(ctx, w, x, y, k, row0, pf, pf_n, stamps, BN: tl.constexpr, BK: tl.constexpr,
                     K: tl.constexpr, AHEAD: tl.constexpr, BACKEND: tl.constexpr):
    gemv_rows_unrolled(w, x, y, k, row0, BN, BK, K, AHEAD, False, ctx, 1, BACKEND, stamps=stamps, STAMP=True)


@warploop.task(signature=STAMP_SIG, constexprs=UP_WE, waits=True, cost=1.0)
@triton.jit
def mlp_up_stamped_pf(ctx, w, x, y, k, row0, pf, pf_n, stamps, BN: tl.constexpr, BK: tl.constexpr,
                      K: tl.constexpr, AHEAD: tl.constexpr, PF_END: tl.constexpr, BACKEND: tl.constexpr):
    gemv_rows_unrolled(w, x, y, k, row0, BN, BK, K, AHEAD, True, ctx, 1, BACKEND, stamps=stamps, STAMP=True,
                       pf=pf, pf_n=pf_n, PF_END=PF_END)


@warploop.task(signature=STAMP_SIG, constexprs=DOWN_WE, waits=True, cost=1.0)
@triton.jit
def mlp_down_stamped_pf(ctx, w, x, y, k, row0, pf, pf_n, stamps, BN: tl.constexpr, BK: tl.constexpr,
                        K: tl.constexpr, AHEAD: tl.constexpr, PF_END: tl.constexpr, BACKEND: tl.constexpr):
    gemv_rows_unrolled(w, x, y, k, row0, BN, BK, K, AHEAD, False, ctx, 1, BACKEND, stamps=stamps, STAMP=True,
                       pf=pf, pf_n=pf_n, PF_END=PF_END)


@warploop.task(signature=STAMP_SIG, constexprs=UP_WR, waits=True, cost=1.0)
@triton.jit
def mlp_up_stamped_rest(ctx, w, x, y, k, row0, pf, pf_n, stamps, BN: tl.constexpr, BK: tl.constexpr,
                        K: tl.constexpr, AHEAD: tl.constexpr, PF_REST: tl.constexpr, BACKEND: tl.constexpr):
    gemv_rows_unrolled(w, x, y, k, row0, BN, BK, K, AHEAD, True, ctx, 1, BACKEND, stamps=stamps, STAMP=True,
                       PF_REST=PF_REST)


@warploop.task(signature=STAMP_SIG, constexprs=DOWN_WR, waits=True, cost=1.0)
@triton.jit
def mlp_down_stamped_rest(ctx, w, x, y, k, row0, pf, pf_n, stamps, BN: tl.constexpr, BK: tl.constexpr,
                          K: tl.constexpr, AHEAD: tl.constexpr, PF_REST: tl.constexpr, BACKEND: tl.constexpr):
    gemv_rows_unrolled(w, x, y, k, row0, BN, BK, K, AHEAD, False, ctx, 1, BACKEND, stamps=stamps, STAMP=True,
                       PF_REST=PF_REST)


@triton.jit
def mlp_persistent(wtab, xtab, ytab, counters, stop_arena, stamps, epoch, NG: tl.constexpr, SYNC: tl.constexpr,
                   AHEAD: tl.constexpr, PF: tl.constexpr):
    """Program t: tile t of GEMV 0..NG-1 (even: up, 32 rows; odd: down, 8 rows), stamped; PF as PF_END."""
    t = tl.program_id(0)
    for g in range(NG):
        nxt = tl.minimum(g + 1, NG - 1)
        pf = tl.load(wtab + nxt).to(tl.pointer_type(tl.bfloat16)) + t * 65536     # its 128 KB tile there
        pf_n = tl.where(g + 1 < NG, 131072, 0)
        w = tl.multiple_of(tl.load(wtab + g).to(tl.pointer_type(tl.bfloat16)), 16)
        x = tl.multiple_of(tl.load(xtab + g).to(tl.pointer_type(tl.bfloat16)), 16)
        y = tl.load(ytab + g).to(tl.pointer_type(tl.bfloat16))
        target = 0
        if SYNC:
            target = tl.where(g > 0, TILES * epoch, 0)
        flags = counters + g - 1
        st = stamps + (g * TILES + t) * 4
        if g % 2 == 0:
            gemv_rows_unrolled(w, x, y, 2048, t * 32, 32, 256, 2048, AHEAD, True, stop_arena, 3, "cuda",
                               flags, target, 1, st, True, pf, pf_n, PF)
        else:
            gemv_rows_unrolled(w, x, y, 8192, t * 8, 8, 1024, 8192, AHEAD, False, stop_arena, 3, "cuda",
                               flags, target, 1, st, True, pf, pf_n, PF)


@triton.jit
def poller(src, n, out, ALL: tl.constexpr):
    """A stand-in for the runtime's front: n rounds of 128 threads x 3 volatile loads of src (pinned
    host memory or device memory), as front_step's uload3 does, summed so they are not dropped."""
    k = tl.arange(0, 128)
    acc = tl.zeros([128], tl.int32)
    for _ in range(n):
        acc += tl.load(src + k % 3, mask=ALL | (k < 3), other=0, volatile=True)
        acc += tl.max(acc, axis=0) & 1
    tl.store(out + k, acc)


def with_poller(torch, where: str, fn, *args, all_threads: bool = True, **kwargs) -> dict:
    """fn(...) while one program polls `where` ("host": pinned host memory, "device") on a side stream."""
    src = torch.zeros(64, dtype=torch.int32, pin_memory=True) if where == "host" else \
        torch.zeros(64, dtype=torch.int32, device="cuda")
    out = torch.zeros(128, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    poller[(1,)](src, 10, out, all_threads, num_warps=4)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    poller[(1,)](src, 20000, out, all_threads, num_warps=4)
    torch.cuda.synchronize()
    poll_us = (time.perf_counter() - t0) / 20000 * 1e6
    with torch.cuda.stream(side):
        poller[(1,)](src, int(40000 / poll_us * 10) if poll_us > 0 else 100000, out, all_threads,
                       num_warps=4)
    r = fn(torch, *args, **kwargs)
    torch.cuda.synchronize()
    r["poll_round_us"] = poll_us
    return r


def boundaries(st, ng: int) -> dict:
    """Boundary anatomy from stamps [ng, TILES, 4] (numpy int64): medians over boundaries, in us."""
    import numpy as np
    t_in, t_wait, t_end = st[..., 0], st[..., 1], st[..., 2]
    last_end = t_end.max(axis=1)
    tail = last_end - np.median(t_end, axis=1)
    detect = np.median(t_wait[1:], axis=1) - last_end[:-1]
    first_wait = t_wait[1:].min(axis=1) - last_end[:-1]
    body = t_end - t_wait
    per_worker = (t_end - t_wait).sum(axis=0)
    gap = t_in[1:] - t_end[:-1]         # a worker's own time between its tiles
    us = lambda a: float(np.median(a)) / 1e3
    slow = int(per_worker.argmax())
    sm = st[0, :, 3]
    counts = np.bincount(sm, minlength=int(sm.max()) + 1)
    levels = np.unique(counts[counts > 0], return_counts=True)      # SMs holding 1, 2, ... workers
    return {"span_us": float(t_end.max() - t_in.min()) / 1e3,
            "tail_us": us(tail), "detect_us": us(detect), "first_wakeup_us": us(first_wait),
            "body_us_median": us(body), "body_us_p90": float(np.percentile(body, 90)) / 1e3,
            "body_us_max": float(body.max()) / 1e3, "between_tiles_us": us(gap),
            "per_gemv_us": us(np.diff(last_end)),
            "worker_busy_max_over_median": float(per_worker.max() / np.median(per_worker)),
            "slowest_worker": slow, "slowest_worker_sm": int(sm[slow]),
            "sms_by_workers": {str(k): int(v) for k, v in zip(*levels, strict=True)},
            "sms_used": int((counts > 0).sum()),
            "worker_busy_us": [round(float(b) / 1e3, 2) for b in per_worker], "worker_sm": [int(v) for v in sm]}


def persistent(torch, w1, w2, x0, sync: bool, ahead: int, pf: int = 0, reps: int = 7) -> dict:
    from warploop.bench.runtime_gpu import DIM, HIDDEN
    layers = len(w1)
    ng = 2 * layers
    h = [torch.empty(HIDDEN, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
    xs = [x0] + [torch.empty(DIM, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
    ws, ins, outs = [], [], []
    for i in range(layers):
        ws += [w1[i], w2[i]]
        ins += [xs[i], h[i]]
        outs += [h[i], xs[i + 1]]
    tab = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device="cuda")
    wtab, xtab, ytab = tab(ws), tab(ins), tab(outs)
    counters = torch.zeros(ng, dtype=torch.int64, device="cuda")
    arena = torch.zeros(L.HEADER_WORDS + L.N_CTL * L.LINE, dtype=torch.int32, device="cuda")
    stamps = torch.zeros(ng, TILES, 4, dtype=torch.int64, device="cuda")
    epoch = [0]

    def launch():
        epoch[0] += 1
        mlp_persistent[(TILES,)](wtab, xtab, ytab, counters, arena, stamps, epoch[0], ng, sync, ahead, pf,
                                 num_warps=4, launch_cooperative_grid=True)

    launch()
    torch.cuda.current_stream().synchronize()   # not the side stream
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        launch()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    out = {"us": statistics.median(times), "sync": sync, "ahead": ahead, "pf": pf, "out": xs[-1].clone(),
           **boundaries(stamps.cpu().numpy(), ng)}
    return out


def runtime_stamped(torch, w1, w2, x0, deps: bool, pf: bool = False, rest: bool = False, repeat: int = 10) -> dict:
    from warploop.bench.runtime_gpu import DIM, HIDDEN, MLP_WORKERS
    layers = len(w1)
    ng = 2 * layers
    h = torch.empty(HIDDEN, dtype=torch.bfloat16, device="cuda")
    xs = [x0] + [torch.empty(DIM, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
    stamps = torch.zeros(ng, TILES, 4, dtype=torch.int64, device="cuda")
    up_t, down_t = ((mlp_up_stamped_pf, mlp_down_stamped_pf) if pf else (mlp_up_stamped_rest, mlp_down_stamped_rest)
                    if rest else (mlp_up_stamped, mlp_down_stamped))
    ws = [w for pair in zip(w1, w2, strict=True) for w in pair]
    with warploop.Runtime(device="cuda", tasks=[up_t, down_t], workers=MLP_WORKERS) as rt:
        g = rt.graph()
        prev, cur = [], []
        for i in range(ng):
            up = i % 2 == 0
            w, x, y, k, bn = ((w1[i // 2], xs[i // 2], h, DIM, UP_W["BN"]) if up
                              else (w2[i // 2], h, xs[i // 2 + 1], HIDDEN, DOWN_W["BN"]))
            prev, cur = cur, []
            for t in range(TILES):
                # pf: this worker's tile of the next GEMV (its next instruction), 128 KB
                nxt = ws[min(i + 1, ng - 1)]
                cur.append(g.add(up_t if up else down_t, w, x, y, k, t * bn, nxt[t * nxt.shape[0] // TILES:],
                                 131072 if pf and i + 1 < ng else 0, stamps[i, t], after=prev if deps else (),
                                 worker=t % MLP_WORKERS))
        g.run(timeout=30)
        per_run = []
        for _ in range(5):
            f = g.launch(repeat=repeat)
            f.result(timeout=30)
            per_run.append(f.device_ns / 1e3 / repeat)
        st = stamps.cpu().numpy()       # the last run's stamps
        out = xs[-1].cpu().cuda()
    return {"us": statistics.median(per_run), "deps": deps, "pf": pf, "rest": rest, "out": out, **boundaries(st, ng)}


def main() -> None:
    import torch

    from warploop.bench.common import header
    from warploop.bench.runtime_gpu import copy_gbs, mlp_weights, reference, rel_err
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--runs", default="persistent_sync_pf_lines,runtime_deps,runtime_nodeps",
                        help="comma-separated parts to run, in order")
    args = parser.parse_args()
    w1, w2, x0 = mlp_weights(torch, args.layers)
    ref = reference(torch, w1, w2, x0)
    bw = copy_gbs(torch)
    weight_bytes = sum(w.numel() * w.element_size() for w in w1 + w2)
    result = {**header("runtime_mlp_probe"), "floor_us": weight_bytes / (bw * 1e9) * 1e6, "copy_gbs": bw}
    runs = {}
    pp = {"sync": True, "ahead": 2, "pf": 1}
    host = lambda one: (lambda t, *a, **k: with_poller(t, "host", persistent, *a, all_threads=not one, **k))
    every = {"persistent_sync_pf_lines": (persistent, pp),
             "persistent_host_poller_all_threads": (host(False), pp),
             "persistent_host_poller_one_thread": (host(True), pp),
             "runtime_deps": (runtime_stamped, {"deps": True}),
             "runtime_nodeps": (runtime_stamped, {"deps": False}),
             "runtime_deps_pf_lines": (runtime_stamped, {"deps": True, "pf": True}),
             "runtime_deps_pf_rest": (runtime_stamped, {"deps": True, "rest": True})}
    for name in args.runs.split(","):
        fn, kw = every[name]
        t0 = time.perf_counter()
        try:
            r = fn(torch, w1, w2, x0, **kw)
            r["rel_err"] = rel_err(torch, r.pop("out"), ref)
        except Exception as exc:  # report and go on: later parts still run
            r = {"error": f"{type(exc).__name__}: {exc}"[:1500]}
        runs[name] = r
        print(f"[probe] {name} ({time.perf_counter() - t0:.1f} s): {r}", flush=True)
    result["runs"] = runs
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
