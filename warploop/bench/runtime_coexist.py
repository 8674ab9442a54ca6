"""The resident runtime as a neighbour: other kernels' speed alone and beside an idle runtime.

A bf16 8192x8192x8192 torch matmul (cuBLAS) and a 1 GiB device-to-device copy are timed with CUDA
events (medians), in one process:

* alone, no runtime open;
* beside an idle runtime with default settings (it parks after 200 us idle: nothing of it runs);
* beside an idle runtime that stays resident (park_after_us=None) on half and on a quarter of the
  SMs (sm_fraction): its front polls host memory and its idle workers poll the ready ring with
  nanosleep back-off. (A resident runtime at the default size holds a program on every SM, and a
  cuBLAS tile needing more than the room left beside it never starts: that case waits for a park.)

Also the cost of parking: submit -> result of a no-op when the runtime is awake vs parked.
No torch.cuda.synchronize() anywhere: beside a resident runtime it would wait for ever.
"""
from __future__ import annotations

import statistics
import time

from warploop.bench.runtime_kernels import noop
from warploop.bench.timing import events_us
from warploop.runtime import layout as L

MATMUL_N = 8192
COPY_BYTES = 1 << 30


def _settle(event, deadline_s: float = 30.0) -> None:
    """Wait for `event` by polling, with a deadline: work that finds no room beside a resident
    kernel never starts, and a blocking synchronize would then wait for ever."""
    deadline = time.perf_counter() + deadline_s
    while not event.query():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"work did not finish in {deadline_s:g} s beside the runtime (no room on the SMs?)")
        time.sleep(1e-4)


def _pair(torch, a, b, out, src, dst) -> tuple[float, float]:
    mm_us = events_us(torch, lambda: torch.matmul(a, b, out=out), reps=10, trials=5, wait=_settle)
    cp_us = events_us(torch, lambda: dst.copy_(src), reps=10, trials=5, wait=_settle)
    return 2 * MATMUL_N**3 / mm_us / 1e6, 2 * COPY_BYTES / cp_us / 1e3     # TFLOP/s, GB/s (read + write)


def _wake_us(torch, rt, task, parked: bool, rounds: int = 50) -> tuple[float, float]:
    """Median submit -> result, and the median host time of the relaunches it paid."""
    samples, resumes = [], []
    for _ in range(rounds):
        if parked:     # wait until every program has exited: the next submit pays the whole relaunch
            be, deadline = rt._backend, time.perf_counter() + 1.0
            while not (be.parked() and be.host[L.HB_EXITED] >= be.programs) and time.perf_counter() < deadline:
                time.sleep(50e-6)
        t0 = time.perf_counter()
        rt.submit(task).result(timeout=10)
        samples.append((time.perf_counter() - t0) * 1e6)
        resumes.append(rt._backend.last_resume_us)
    return statistics.median(samples), statistics.median(resumes)


def coexist_figures(torch) -> dict:
    import warploop
    a = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    src = torch.randint(0, 256, (COPY_BYTES,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    mm_alone, cp_alone = _pair(torch, a, b, out, src, dst)
    fig = {"matmul_alone_tflops": mm_alone, "copy_alone_gbps": cp_alone}
    with warploop.Runtime(tasks=[noop]) as rt:
        rt.submit(noop).result(timeout=30)
        mm, cp = _pair(torch, a, b, out, src, dst)
        fig.update(matmul_beside_tflops=mm, copy_beside_gbps=cp, workers=rt.workers,
                   relaunches=rt._backend.relaunches)
        fig["submit_awake_us"] = _wake_us(torch, rt, noop, parked=False)[0]
        fig["submit_after_park_us"], fig["relaunch_host_us"] = _wake_us(torch, rt, noop, parked=True)
    fig["matmul_beside_pct"] = 100 * fig["matmul_beside_tflops"] / mm_alone
    fig["copy_beside_pct"] = 100 * fig["copy_beside_gbps"] / cp_alone
    for label, fraction in (("resident_half", 0.5), ("resident_quarter", 0.25)):
        with warploop.Runtime(tasks=[noop], park_after_us=None, sm_fraction=fraction) as rt:
            rt.submit(noop).result(timeout=30)
            fig[f"{label}_workers"] = rt.workers
            try:
                mm, cp = _pair(torch, a, b, out, src, dst)
            except TimeoutError as exc:
                fig[f"{label}_error"] = str(exc)
                continue
            fig.update({f"matmul_beside_{label}_tflops": mm, f"copy_beside_{label}_gbps": cp,
                        f"matmul_beside_{label}_pct": 100 * mm / mm_alone,
                        f"copy_beside_{label}_pct": 100 * cp / cp_alone})
    return fig


if __name__ == "__main__":
    import json

    import torch
    print(json.dumps(coexist_figures(torch), indent=1))
