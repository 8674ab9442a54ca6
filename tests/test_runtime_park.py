"""Parking, the front's half, on the CPU: the GPU's own resident loop (interpreted, one program)
runs queued work, finds itself idle, parks with its state kept, and runs new work when launched
again the way GpuBackend.resume() launches it."""
import numpy as np
import torch

import warploop
from warploop.bench.runtime_kernels import tick
from warploop.runtime import interp
from warploop.runtime import layout as L


def _launch(rt):
    be = rt._backend
    interp.launch(be.module.resident, (1,), be.arena, INLINE=True, TRACE=False, BACKEND="cpu")


def _relaunch(rt):
    """What GpuBackend.resume() does between a park and the next launch."""
    be = rt._backend
    assert be.host[L.HB_PARK] & 1
    be.a64[be.layout.ctl_word(L.C_STOP) // 2] = L.RUN
    be.a64[be.layout.ctl_word(L.C_EXITED) // 2] = 0
    be.host[L.HB_EXITED] = 0
    be.host[L.HB_PARK] += 1
    _launch(rt)


def test_idle_runtime_parks_and_resumes_with_its_state():
    x = torch.zeros(1, dtype=torch.int32)
    with warploop.Runtime(device="cpu", workers=1, tasks=[tick]) as rt:
        be = rt._backend
        be.a64[L.H_PARK_NS // 2] = 0            # park as soon as it is idle
        first = [rt.submit(tick, x) for _ in range(3)]
        _launch(rt)
        assert all(f.done() for f in first) and int(x[0]) == 3
        assert be.host[L.HB_PARK] == 1 and be.host[L.HB_EXITED] == 1
        assert be.a64[be.layout.ctl_word(L.C_STOP) // 2] == L.PARK
        assert not rt.submit(tick, x).done()    # queued in the host ring; nothing runs it while parked
        _relaunch(rt)
        assert int(x[0]) == 4 and be.host[L.HB_PARK] == 3
        # Task ids and the submit head carried over the park: the pool's state was kept.
        assert be.a64[be.layout.ctl_word(L.C_NEXT_ID) // 2] == 4
        assert be.a64[be.layout.ctl_word(L.C_SUBMIT_HEAD) // 2] == 4


def test_runtime_never_parks_while_work_is_live_or_parking_is_off():
    x = torch.zeros(1, dtype=torch.int32)
    with warploop.Runtime(device="cpu", workers=1, tasks=[tick]) as rt:
        be = rt._backend
        assert be.a64[L.H_PARK_NS // 2] == -1     # the CPU executor never parks
        rt.submit(tick, x).result(timeout=10)
        assert be.host[L.HB_PARK] == 0 and int(x[0]) == 1
        np.testing.assert_equal(be.a64[be.layout.ctl_word(L.C_STOP) // 2], L.RUN)


def test_the_host_asks_for_a_park_before_the_idle_time_is_out():
    """Runtime.park(): with an idle time of 10 s the front parks at its first idle round when the
    host block's park request is set (the GPU's wait for the exit is the other half)."""
    x = torch.zeros(1, dtype=torch.int32)
    with warploop.Runtime(device="cpu", workers=1, tasks=[tick]) as rt:
        be = rt._backend
        be.a64[L.H_PARK_NS // 2] = 10 * 10 ** 9
        done = [rt.submit(tick, x) for _ in range(2)]
        be.host[L.HB_PARK_NOW] = 1
        _launch(rt)                               # returns only because the kernel parked
        assert all(f.done() for f in done) and int(x[0]) == 2
        assert be.host[L.HB_PARK] == 1 and be.host[L.HB_EXITED] == 1
        assert rt.park() is False                 # the CPU executor itself holds no SMs: nothing to park
