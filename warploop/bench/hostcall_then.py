"""`warploop bench hostcall`, the continuation part: a host call whose reply resumes a task.

    then_p50_us, then_p99_us   a runtime task posts a no-op `call_async(then=std.token(h))` and
                               returns; device time from its post to the start of the continuation
                               that `wl.then(h, ...)` attached (the std server's reply, then the
                               runtime's submit ring: host -> front -> ready ring -> a worker)

A chain: each continuation posts the next call, so one call is in flight at a time, as in
call_p50_us (the same inline no-op function), which is the peer: the difference is what resuming
a continuation costs over a worker that waits for the reply.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

import warploop
from warploop.runtime import device as wl
from warploop.std import HostCalls, intern
from warploop.std import device as std

NOOP_NAME = "warploop.bench.hostcall_then.noop"
NOOP = intern(NOOP_NAME)


@warploop.task(signature={"times": "*i64", "n": "i32", "i": "i32", "t0": "i64"}, constexprs={"FN": NOOP})
@triton.jit
def then_step(ctx, times, n, i, t0, FN: tl.constexpr):
    if i > 0:
        tl.store(times + i - 1, std.clock() - t0)
    if i < n:
        h = wl.external(ctx)
        t = std.clock()
        std.call_async(std.task_port(ctx, 1), FN, then=std.token(h))
        wl.then(ctx, h, then_step, times, n, i + 1, t)


def measure_then(gpu: bool, n: int) -> dict:
    """p50/p99 of post -> continuation start, over a chain of n calls (the first 10% dropped)."""
    device = "cuda" if gpu else "cpu"
    times = torch.zeros(n, dtype=torch.int64, device=device)
    calls = HostCalls(device=device)
    calls.register_function(NOOP_NAME, lambda: 0, inline=True)
    with calls, warploop.Runtime(device=device, tasks=[then_step], ports=calls.ports) as rt:
        calls.bind(rt)
        rt.submit(then_step, times, min(n, 20), 0, 0).result(timeout=120)    # warm
        rt.submit(then_step, times, n, 0, 0).result(timeout=120)
    us = np.sort(times.cpu().numpy()[n // 10:]) / 1e3
    if not (us > 0).all():
        raise RuntimeError("a continuation did not record its time: the chain broke")
    return {"then_p50_us": float(np.percentile(us, 50)), "then_p99_us": float(np.percentile(us, 99))}
