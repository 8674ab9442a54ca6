"""Where a host submission's round trip goes: device stamps along its path, and the bus floor.

    from warploop.bench.runtime_submit import submit_breakdown
    with warploop.Runtime(tasks=HOP_TASKS, ...) as rt:
        figures = submit_breakdown(rt, rounds=1000)

`submit_breakdown` submits a no-op task `rounds` times, one at a time, and after each reads the
submit stamps (layout.STAMP_*: GPU global-timer readings the front and the worker write when the
host turns them on) back from the arena. Device stages are differences of device stamps, and the
host figures are host clock differences: the two clocks are never mixed. Per stage it reports
the median and the 90th percentile in microseconds:

    front_round       the front round before the one that took the slot: a submission waits for
                      the front's next poll, so on average half a round
    poll_read         the front's poll of host memory (stop word, slot sequence, graph request)
    desc_read         the descriptor read after the poll saw the slot
    alloc_push        task allocation and the ready-ring push
    wake              push -> an idle worker popped it (worker stages need worker.py to pass
                      BACKEND to try_pop and complete; null otherwise)
    run               pop -> the body returned (descriptor checks, dispatch, the body)
    bookkeeping       body returned -> completion write starts
    completion        completion record stores, release fence and system-scope atomic, until the
                      atomic's reply
    device_total      poll issued -> completion atomic answered
    host_total        submit() -> result() returned, on the host clock

`bus_floor` measures what any host -> GPU -> host path must pay: the GPU's dependent read latency
of pinned host memory and of device memory, system-scope atomics on host memory, and a host <->
GPU ping-pong through pinned memory (host writes a word, one GPU thread polls it and writes an
answer the host polls), each for three ways to write the answer. Call it before opening the
Runtime: loading a kernel's module while the resident kernel runs blocks until that ends.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import triton
import triton.language as tl

from warploop.bench.runtime_kernels import noop
from warploop.bench.timing import pct
from warploop.runtime import layout as L
from warploop.runtime.sync import clock_after

PROBE_CHAIN = 256          # dependent reads per probe
PING_ROUNDS = 2000         # host <-> GPU ping-pong rounds per answer kind
SPIN_LIMIT = tl.constexpr(1 << 24)   # a probe's GPU poll gives up after this many reads (the host died)
ANSWERS = ("release_sys_atomic", "relaxed_sys_atomic", "plain_store")


def _summary(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"p50_us": statistics.median(values), "p90_us": pct(values, 0.9), "p99_us": pct(values, 0.99),
            "mean_us": statistics.fmean(values)}


def _stamp_offset(rt) -> int:
    return rt.layout.ctl_word(L.C_SUBMIT_HEAD)


def _read_stamps(rt) -> np.ndarray:
    """The int64 stamps, copied from the arena (a side-stream copy on the GPU: the kernel runs on)."""
    base = _stamp_offset(rt) + L.STAMP_BASE
    arena = rt._backend.arena
    if rt.backend == "cpu":
        words = arena[base:base + 2 * len(L.STAMP_NAMES)].numpy().copy()
    else:
        import torch
        with torch.cuda.stream(rt._backend.side):
            words = arena[base:base + 2 * len(L.STAMP_NAMES)].to("cpu").numpy()
    return words.view(np.int64)


def _set_stamping(rt, on: bool) -> None:
    rt._backend.write_arena(_stamp_offset(rt) + L.STAMP_ON, np.array([int(on)], dtype=np.int32))


STAGES = (("front_round", L.ST_PREV_ROUND, L.ST_POLL), ("poll_read", L.ST_POLL, L.ST_SEEN),
          ("desc_read", L.ST_SEEN, L.ST_DESC), ("alloc_push", L.ST_DESC, L.ST_PUSHED),
          ("wake", L.ST_PUSHED, L.ST_POPPED), ("run", L.ST_POPPED, L.ST_BODY_DONE),
          ("bookkeeping", L.ST_BODY_DONE, L.ST_NOTIFY), ("completion", L.ST_NOTIFY, L.ST_NOTIFIED),
          ("device_total", L.ST_POLL, L.ST_NOTIFIED))
WORKER_STAMPS = (L.ST_POPPED, L.ST_BODY_DONE, L.ST_NOTIFY, L.ST_NOTIFIED)


def submit_breakdown(rt, rounds: int = 1000, task=None, floor: dict | None = None) -> dict:
    """Per-stage device times of `rounds` no-op submissions, one at a time, and the host's totals.

    task: a task of `rt` that takes no arguments (default: warploop.bench.runtime_kernels.noop).
    floor: bus_floor()'s figures, taken before `rt` opened, to report beside the stages.
    """
    task = noop if task is None else task
    for _ in range(max(10, rounds // 10)):
        rt.submit(task).result()
    gpu = rt.backend != "cpu"
    if gpu:
        _set_stamping(rt, True)
    stages: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
    host_total, host_own, stale = [], [], 0
    try:
        for _ in range(rounds):
            t0 = time.perf_counter_ns()
            f = rt.submit(task)
            t1 = time.perf_counter_ns()
            f.result()
            t2 = time.perf_counter_ns()
            f.result()
            host_own.append((t1 - t0 + time.perf_counter_ns() - t2) / 1e3)
            host_total.append((t2 - t0) / 1e3)
            if not gpu:
                continue
            st = _read_stamps(rt)
            if st[L.ST_TAKEN_TICKET] != f.ticket:
                stale += 1
                continue
            worker = st[L.ST_DONE_TICKET] == f.ticket and all(st[i] > 0 for i in WORKER_STAMPS)
            for name, a, b in STAGES:
                if worker or (a not in WORKER_STAMPS and b not in WORKER_STAMPS):
                    stages[name].append((int(st[b]) - int(st[a])) / 1e3)
    finally:
        if gpu:
            _set_stamping(rt, False)
    out = {"rounds": rounds, "host_total": _summary(host_total), "host_own": _summary(host_own),
           "stamped_rounds": len(stages["poll_read"]), "stale_rounds": stale,
           "worker_stamps": bool(stages["wake"]), "stages": {k: _summary(v) for k, v in stages.items()}}
    if floor is not None:
        out["bus_floor"] = floor
    return out


# -- the bus floor ---------------------------------------------------------------------------------
@triton.jit
def _read_chain(host, dev, out, N: tl.constexpr):
    """Dependent reads: N of pinned host memory, N of device memory; system-scope atomics on host memory."""
    idx = tl.load(host, volatile=True)
    t0 = clock_after(idx.to(tl.int64), "cuda")
    for _ in range(N):
        idx = tl.load(host + idx, volatile=True)
    t1 = clock_after(idx.to(tl.int64), "cuda")
    for _ in range(N):
        idx = tl.load(dev + idx, volatile=True)
    t2 = clock_after(idx.to(tl.int64), "cuda")
    v = idx
    for _ in range(N):
        v = tl.atomic_xchg(host + 32 + v, v, sem="release", scope="sys")
    t3 = clock_after(v.to(tl.int64), "cuda")
    for _ in range(N):
        v = tl.atomic_xchg(host + 32 + v, v, sem="relaxed", scope="sys")
    t4 = clock_after(v.to(tl.int64), "cuda")
    k = tl.arange(0, 4)
    dt = tl.where(k == 0, t1 - t0, tl.where(k == 1, t2 - t1, tl.where(k == 2, t3 - t2, t4 - t3)))
    tl.store(out + k, dt)


@triton.jit
def _ping_pong(flag, answer, n, ANSWER: tl.constexpr):
    """For i in 1..n: wait until *flag == i (host memory), then write i to *answer."""
    for i in range(1, n + 1):
        spins = 0
        v = tl.load(flag, volatile=True)
        while (v != i) & (spins < SPIN_LIMIT):
            v = tl.load(flag, volatile=True)
            spins += 1
        if ANSWER == "release_sys_atomic":
            tl.atomic_xchg(answer, v, sem="release", scope="sys")
        elif ANSWER == "relaxed_sys_atomic":
            tl.atomic_xchg(answer, v, sem="relaxed", scope="sys")
        else:
            tl.inline_asm_elementwise("st.relaxed.sys.global.b32 [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                                      [answer, v], dtype=tl.int32, is_pure=False, pack=1)



def bus_floor(device="cuda") -> dict:
    """The GPU's latencies to pinned host memory and a host <-> GPU ping-pong, in microseconds.

    One-warp probe kernels; run it while no resident kernel runs (see the module docstring)."""
    import torch
    host = torch.zeros(64, dtype=torch.int32, pin_memory=True)
    dev = torch.zeros(64, dtype=torch.int32, device=device)
    out = torch.zeros(4, dtype=torch.int64, device=device)
    stream = torch.cuda.Stream(device)
    chains = []
    with torch.cuda.stream(stream):
        for _ in range(6):
            _read_chain[(1,)](host, dev, out, N=PROBE_CHAIN, num_warps=1)
            chains.append(out.to("cpu").tolist())
    chains = chains[1:]
    floor = {name: statistics.median(c[i] for c in chains) / PROBE_CHAIN / 1e3
             for i, name in enumerate(("host_read_us", "device_read_us", "release_sys_atomic_us",
                                       "relaxed_sys_atomic_us"))}
    h = host.numpy()
    for answer in ANSWERS:
        h[:] = 0
        with torch.cuda.stream(stream):
            _ping_pong[(1,)](host[0:], host[16:], PING_ROUNDS, ANSWER=answer, num_warps=1)
        times = []
        for i in range(1, PING_ROUNDS + 1):
            t0 = time.perf_counter_ns()
            h[0] = i
            spins = 0
            while h[16] != i:
                spins += 1
                if spins & 0xFFFF == 0 and time.perf_counter_ns() - t0 > 1e9:
                    raise TimeoutError(f"the ping-pong probe ({answer}) did not answer round {i} within 1 s")
            times.append((time.perf_counter_ns() - t0) / 1e3)
        stream.synchronize()
        floor[f"ping_pong_{answer}"] = _summary(times[PING_ROUNDS // 10:])
    return floor
