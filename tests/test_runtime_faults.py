"""Faults: hangs become TimeoutError naming tasks and workers, bad descriptors become errors."""
import re

import pytest
import torch
import triton
import triton.language as tl

import warploop
from warploop.runtime import device as wl
from warploop.runtime.descriptor import TaskDescriptor
from warploop.runtime.errors import RuntimeFault, TaskError


@warploop.task(signature={"x": "*i32"})
@triton.jit
def hang(ctx, x):
    """Joins itself: can never complete."""
    wl.join(ctx, wl.task_id(ctx))
    tl.store(x, 1)


@warploop.task(signature={"x": "*i32", "n": "i32"})
@triton.jit
def endless(ctx, x, n):
    """Re-submits itself forever through a continuation."""
    tl.atomic_add(x, 1)
    wl.then(ctx, wl.spawn(ctx, ok, x), endless, x, n)


@warploop.task(signature={"x": "*i32"})
@triton.jit
def ok(x):
    tl.atomic_add(x, 1)


@warploop.task(signature={"x": "*i32", "n": "i32"})
@triton.jit
def flood(ctx, x, n):
    for _ in range(n):
        wl.spawn(ctx, ok, x)


TASKS = [hang, endless, ok, flood]


def test_deadlock_raises_timeout_naming_task_and_worker():
    with warploop.Runtime(device="cpu", tasks=TASKS, workers=2) as rt:
        with pytest.raises(TimeoutError) as info:
            rt.submit(hang, torch.zeros(1, dtype=torch.int32)).result(timeout=10)
        text = str(info.value)
        assert "deadlock" in text and "test_runtime_faults.hang" in text
        joining = re.search(r"worker 0: joining handle (\d+) \(task (\d+)\)", text)
        assert joining and joining[1] == joining[2]          # it joins itself


def test_runaway_work_times_out():
    with warploop.Runtime(device="cpu", tasks=TASKS, workers=2) as rt:
        x = torch.zeros(1, dtype=torch.int32)
        # Long enough for the interpreter's first (cold) steps on a loaded machine: the deadline also
        # interrupts a step that outlives it, and this test wants steps to have run.
        with pytest.raises(TimeoutError, match="timed out after 2 s") as info:
            rt.submit(endless, x, 0).result(timeout=2.0)
        assert "test_runtime_faults.endless" in str(info.value)
        assert int(x) > 1
        rt.close(timeout=0.2)            # cannot drain: gives up and aborts


def test_invalid_opcode_fails_the_task_not_the_runtime():
    with warploop.Runtime(device="cpu", tasks=TASKS, workers=2) as rt:
        with pytest.raises(TaskError, match="invalid opcode"):
            rt.submit_descriptor(TaskDescriptor(opcode=12345)).result(timeout=10)
        bad = TaskDescriptor(opcode=ok.opcode, args=(0,), signal=3)     # graph fields in a dynamic task
        with pytest.raises(TaskError, match="invalid task descriptor"):
            rt.submit_descriptor(bad).result(timeout=10)
        x = torch.zeros(1, dtype=torch.int32)
        rt.submit(ok, x).result(timeout=10)                                  # still serving
        assert int(x) == 1


def test_bad_graph_descriptor_faults_the_runtime():
    with warploop.Runtime(device="cpu", tasks=TASKS, workers=2) as rt:
        x = torch.zeros(1, dtype=torch.int32)
        g = rt.graph()
        g.add(ok, x)
        g.compile()
        g._tensors[0][3] = 999           # signal counter index out of range
        with pytest.raises(RuntimeFault, match="invalid task descriptor"):
            g.run(timeout=10)
        assert int(x) == 0               # the body never ran


def test_spawns_past_a_full_pool_run_inline():
    with warploop.Runtime(device="cpu", tasks=TASKS, workers=2, pool=8) as rt:
        x = torch.zeros(1, dtype=torch.int32)
        rt.submit(flood, x, 20).result(timeout=30)       # 8 children in the pool, 12 in the reserve
        assert int(x) == 20


def test_pool_exhaustion_is_a_fault_naming_pool_not_a_hang():
    # One body spawning more children than the shared pool and its worker's reserve (64) hold:
    # on the CPU executor nothing runs while the body loops, so every child is alive at once.
    x = torch.zeros(1, dtype=torch.int32)
    with warploop.Runtime(device="cpu", tasks=TASKS, workers=2, pool=8, reserve=64) as rt:
        # alive: the root (in a slot of the front's), 8 children in the pool, 64 in the reserve
        with pytest.raises(RuntimeFault, match=r"pool is full: 73 tasks alive in pool=8 .*Runtime\(pool="):
            rt.submit(flood, x, 100).result(timeout=30)


def test_close_after_exception_and_use_after_close():
    x = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(KeyError):
        with warploop.Runtime(device="cpu", tasks=TASKS, workers=2) as rt:
            rt.submit(ok, x)
            raise KeyError("boom")
    assert rt._closed
    with pytest.raises(RuntimeError, match="closed"):
        rt.submit(ok, x)


def test_a_timeout_report_on_hundreds_of_workers_names_the_one_at_work():
    """A GPU runtime has hundreds of workers, and after a relaunch the idle ones may still read as
    exited: the report's few lines must show the worker joining (seen on an H100: 263 workers, the
    joining one past the first 12 lines, so the report never said what hung)."""
    from warploop.runtime.status import PendingTask, RuntimeStatus, WorkerState
    workers = [WorkerState(i, "exited", -1, -1, 0) for i in range(263)]
    workers[200] = WorkerState(200, "joining", 71424, -1, 71424)
    status = RuntimeStatus(workers=tuple(workers), pending=(PendingTask(71424, 1, "self_join", -1, 1),),
                           issued=1, completed=0, ready=0, graph_runs=0, error=None)
    text = status.describe()
    assert "worker 200: joining handle 71424 (task 71424)" in text.splitlines()[2]
    assert len(text.splitlines()) <= 2 + 12 + 2
