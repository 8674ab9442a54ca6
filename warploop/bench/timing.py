"""Timing helpers shared by the benches: device time by CUDA events, CUDA graph capture, the copy
rate that sets every floor, and the host's submit -> result latency."""
from __future__ import annotations

import statistics
import time


def events_us(torch, fn, reps: int = 1, trials: int = 7, wait=None) -> float:
    """Median over trials of device time per call of fn (CUDA events). `wait(event)` waits for an
    event; by default a device synchronisation, so no runtime may be open (runtime_coexist passes
    a polling wait with a deadline instead)."""
    fn()
    if wait is None:
        torch.cuda.synchronize()
    else:
        warm = torch.cuda.Event()
        warm.record()
        wait(warm)
    times = []
    for _ in range(trials):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        e.synchronize() if wait is None else wait(e)
        times.append(s.elapsed_time(e) * 1e3 / reps)
    return statistics.median(times)


def seconds(fn, device) -> float:
    """One call of fn: device time by CUDA events on a GPU, wall time on the CPU."""
    import torch
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def copy_gbs(torch) -> float:
    src = torch.randint(0, 256, (1 << 30,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = events_us(torch, lambda: dst.copy_(src), reps=5)
    return 2 * (1 << 30) / us / 1e3       # bytes read + written


def graph_of(torch, fn, reps: int):
    """fn called reps times, captured in a CUDA graph (after one eager call that compiles it)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(reps):
            fn()
    return graph


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def submit_latency(rt, task, args: tuple, rounds: int) -> tuple[float, float, float]:
    """p50 and p99 of submit -> result, and the p50 of the host's own part: the submit() call
    (argument checks, slot write) and the Python around result() measured on a settled future."""
    for _ in range(max(10, rounds // 10)):
        rt.submit(task, *args).result()
    samples, host = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        f = rt.submit(task, *args)
        t1 = time.perf_counter()
        f.result()
        t2 = time.perf_counter()
        f.result()
        host.append((t1 - t0 + time.perf_counter() - t2) * 1e6)
        samples.append((t2 - t0) * 1e6)
    return statistics.median(samples), pct(samples, 0.99), statistics.median(host)
