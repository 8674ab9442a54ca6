"""Dynamic work on the CPU executor: submit, spawn, join, then, structured completion."""
import pytest
import torch
import triton
import triton.language as tl

import warploop
from warploop.runtime import device as wl


@warploop.task(signature={"log": "*i32", "cursor": "*i32", "tag": "i32"})
@triton.jit
def note(log, cursor, tag):
    tl.store(log + tl.atomic_add(cursor, 1), tag)


@warploop.task(signature={"log": "*i32", "cursor": "*i32", "tag": "i32", "fanout": "i32"})
@triton.jit
def fan(ctx, log, cursor, tag, fanout):
    """Spawn `fanout` notes (tags tag+1..), then note `tag` itself."""
    for i in range(fanout):
        wl.spawn(ctx, note, log, cursor, tag + 1 + i)
    tl.store(log + tl.atomic_add(cursor, 1), tag)


@warploop.task(signature={"log": "*i32", "cursor": "*i32"})
@triton.jit
def spawn_then_join(ctx, log, cursor):
    h = wl.spawn(ctx, fan, log, cursor, 10, 3)        # notes 10, 11, 12, 13 (the tree of h)
    wl.then(ctx, h, note, log, cursor, 99)           # strictly after the whole tree of h
    wl.join(ctx, h)
    tl.store(log + tl.atomic_add(cursor, 1), 50)     # after h's tree, maybe before 99
    wl.set_result(ctx, wl.task_id(ctx) * 0 + 7)


@warploop.task(signature={"depth": "i32", "out": "*i64"})
@triton.jit
def chain(ctx, depth, out):
    """A chain of continuations: each link attaches the next to a spawned no-op child."""
    if depth > 0:
        h = wl.spawn(ctx, chain, 0, out)
        wl.then(ctx, h, chain, depth - 1, out)
    tl.atomic_add(out, 1)


@pytest.fixture(scope="module")
def rt():
    with warploop.Runtime(device="cpu", tasks=[note, fan, spawn_then_join, chain], workers=3) as runtime:
        yield runtime


def logged(log, cursor):
    return log[:int(cursor)].tolist()


def test_submit_runs_and_returns_result(rt):
    log, cursor = torch.full((8,), -1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    futures = [rt.submit(note, log, cursor, t) for t in (5, 6, 7)]
    assert [f.result(timeout=30) for f in futures] == [0, 0, 0]
    assert sorted(logged(log, cursor)) == [5, 6, 7]
    assert all(f.done() for f in futures)


def test_spawn_join_then_ordering(rt):
    log, cursor = torch.full((16,), -1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    assert rt.submit(spawn_then_join, log, cursor).result(timeout=30) == 7
    order = logged(log, cursor)
    assert sorted(order) == [10, 11, 12, 13, 50, 99]
    tree = {10, 11, 12, 13}
    assert order.index(99) > max(order.index(t) for t in tree)    # then: after the whole tree
    assert order.index(50) > max(order.index(t) for t in tree)    # join: after the whole tree


def test_structured_completion_waits_for_continuations(rt):
    out = torch.zeros(1, dtype=torch.int64)
    rt.submit(chain, 5, out).result(timeout=30)
    # 6 links + 5 spawned no-op children, all done before the root's future resolved
    assert int(out) == 11
    status = rt.status()
    assert status.issued == status.completed and not status.pending


def test_unknown_task_is_rejected_on_the_host(rt):
    @warploop.task(signature={"x": "*i32"})
    @triton.jit
    def outsider(x):
        tl.store(x, 1)

    with pytest.raises(ValueError, match="not part of this Runtime"):
        rt.submit(outsider, torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="is on meta, but this runtime runs on cpu"):
        rt.submit(note, torch.zeros(1, dtype=torch.int32, device="meta"), torch.zeros(1, dtype=torch.int32), 0)


def test_many_submits_reuse_slots(rt):
    log, cursor = torch.zeros(40, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    small = warploop.Runtime(device="cpu", tasks=[note], workers=2, submit_slots=4)
    with small:
        futures = [small.submit(note, log, cursor, i) for i in range(10)]   # wraps the 4-slot ring twice
        for f in futures:
            f.result(timeout=30)
    assert sorted(logged(log, cursor)) == list(range(10))


@pytest.mark.parametrize("workers", [0, -2, 1.5, "all"])
def test_runtime_refuses_bad_worker_counts_before_starting(workers):
    with pytest.raises(ValueError, match="workers=.*: use a number of worker programs >= 1, \"fill\""):
        warploop.Runtime(device="cpu", tasks=[note], workers=workers)


@pytest.mark.parametrize("regs", [16, 256, 100.5, "128"])
def test_runtime_refuses_bad_register_caps_before_starting(regs):
    with pytest.raises(ValueError, match="max_registers=.*: use a number of registers per thread from 32 to 255"):
        warploop.Runtime(device="cpu", tasks=[note], max_registers=regs)


def test_a_register_cap_is_a_cuda_option_the_cpu_executor_ignores():
    with warploop.Runtime(device="cpu", tasks=[note], max_registers=128) as rt:
        assert rt.workers >= 1


def test_fill_takes_the_executors_default_on_the_cpu():
    with warploop.Runtime(device="cpu", tasks=[note], workers="fill") as rt:
        with warploop.Runtime(device="cpu", tasks=[note]) as default:
            assert rt.workers == default.workers >= 1
