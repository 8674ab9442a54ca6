"""Every host wait has a way out: a task body that never returns, and a runtime closed under a wait."""
import threading
import time

import pytest
import torch
import triton
import triton.language as tl

import warploop
from warploop.runtime import device as wl


@warploop.task(signature={"flag": "*i32"})
@triton.jit
def spin(flag):
    """Counts in flag[1] until flag[0] becomes nonzero, which nobody does: a body that never returns."""
    go = tl.load(flag, volatile=True) == 0
    while go:
        tl.atomic_add(flag + 1, 1)
        go = tl.load(flag, volatile=True) == 0


@warploop.task(signature={"x": "*i32"})
@triton.jit
def bump(x):
    tl.atomic_add(x, 1)


@warploop.task(signature={"x": "*i32"})
@triton.jit
def park(ctx, x):
    """Completes only after the host completes an external handle, which nobody does."""
    wl.then(ctx, wl.external(ctx), bump, x)


TASKS = [spin, bump]
MARGIN_S = 0.5     # the watchdog's grace (0.05 s) plus a loaded 2-core machine's scheduling


def test_a_looping_body_times_out_within_the_deadline():
    flag = torch.zeros(2, dtype=torch.int32)
    with warploop.Runtime(device="cpu", tasks=TASKS, workers=2) as rt:
        warm = torch.zeros(2, dtype=torch.int32)           # held while the task can write it
        rt.submit(bump, warm).result(timeout=60)           # the interpreter warmed up
        future = rt.submit(spin, flag)
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError, match="was interrupted") as info:
            future.result(timeout=0.5)
        assert time.perf_counter() - t0 < 0.5 + MARGIN_S
        assert "test_runtime_waits.spin" in str(info.value) and "worker 0: running (task " in str(info.value)
        assert int(flag[1]) > 0            # the body really ran (and spun) until the interrupt
        t0 = time.perf_counter()
        rt.close(timeout=0.3)          # the abandoned task cannot drain: close gives up and aborts in time
        assert time.perf_counter() - t0 < 0.3 + MARGIN_S


def test_the_runtime_keeps_serving_after_an_interrupted_body():
    flag = torch.zeros(2, dtype=torch.int32)     # held: a freed tensor's memory could end the loop
    with warploop.Runtime(device="cpu", tasks=TASKS, workers=2) as rt:
        with pytest.raises(TimeoutError):
            rt.submit(spin, flag).result(timeout=0.3)
        x = torch.zeros(2, dtype=torch.int32)
        rt.submit(bump, x).result(timeout=30)      # another worker serves it; no stray interrupt lands
        time.sleep(0.1)
        assert int(x[0]) == 1
        rt.close(abort=True)


def test_close_with_a_looping_body_queued_returns_in_time():
    flag = torch.zeros(2, dtype=torch.int32)
    rt = warploop.Runtime(device="cpu", tasks=TASKS, workers=2)
    future = rt.submit(spin, flag)
    t0 = time.perf_counter()
    rt.close(timeout=0.3)              # drains: runs the body, which never returns
    assert time.perf_counter() - t0 < 0.3 + MARGIN_S
    with pytest.raises(RuntimeError, match=r"close\(\)"):
        future.result(timeout=30)


def test_futures_of_a_closed_runtime_fail_at_once():
    rt = warploop.Runtime(device="cpu", tasks=TASKS, workers=2)
    x = torch.zeros(2, dtype=torch.int32)
    done = rt.submit(bump, x)
    done.result(timeout=30)
    flag = torch.zeros(2, dtype=torch.int32)
    pending = rt.submit(spin, flag)
    g = rt.graph()
    g.add(spin, flag)
    queued = g.launch()
    rt.close(abort=True)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"Runtime was closed \(close\(\)\)"):
        pending.result(timeout=30)
    with pytest.raises(RuntimeError, match=r"graph request 1 cannot complete.*close\(\)"):
        queued.result(timeout=30)
    assert time.perf_counter() - t0 < 1.0
    assert done.result(timeout=30) == 0          # a future settled before close keeps its result


def test_close_on_another_thread_ends_a_wait():
    x = torch.zeros(2, dtype=torch.int32)
    rt = warploop.Runtime(device="cpu", tasks=TASKS + [park], workers=1)
    future = rt.submit(park, x)        # waits on the host forever: the executor sleeps, polling

    def closer():
        time.sleep(0.3)
        # What close() leaves behind (on the GPU it runs on any thread; the CPU executor is driven by
        # the waiting thread, so this stands in for it without driving the executor from here).
        rt._stopped = True

    threading.Thread(target=closer).start()
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"close\(\)"):
        future.result(timeout=20.0)
    assert time.perf_counter() - t0 < 0.3 + MARGIN_S
    rt.close(abort=True)
