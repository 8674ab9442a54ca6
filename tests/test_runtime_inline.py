"""Dynamic work at any size on the CPU executor: spawns into a full pool run inline on the spawner.

pool=2 keeps the shared pool full almost at once, so these programs run mostly on the workers'
reserved slots; with the old id-per-slot pool each of them faulted ("pool is full") or deadlocked.
Sizes are what the interpreter runs in a few seconds (about 20-40 tasks/s on a loaded 2-core
machine); tests/test_runtime_dynamic_gpu.py runs the 1M-task fan-out and depth-20 recursion.
"""
import torch
import triton
import triton.language as tl

import warploop
from warploop.runtime import device as wl
from warploop.runtime import layout as L
from warploop.runtime.sync import p64


@warploop.task(signature={"log": "*i32", "cursor": "*i32", "tag": "i32"})
@triton.jit
def record(ctx, log, cursor, tag):
    """Append (tag, worker) to the log."""
    at = tl.atomic_add(cursor, 1)
    tl.store(log + 2 * at, tag)
    tl.store(log + 2 * at + 1, wl.worker_id(ctx))


@warploop.task(signature={"log": "*i32", "cursor": "*i32", "n": "i32"})
@triton.jit
def spawn_n(ctx, log, cursor, n):
    """Spawn record(10), record(11), ... record(9 + n), then record 0 itself."""
    for i in range(n):
        wl.spawn(ctx, record, log, cursor, 10 + i)
    record(ctx, log, cursor, 0)


@warploop.task(signature={"log": "*i32", "cursor": "*i32"})
@triton.jit
def spawn_join(ctx, log, cursor):
    wl.spawn(ctx, record, log, cursor, 0)             # the pool's 2 shared slots: the ring
    wl.spawn(ctx, record, log, cursor, 1)
    h = wl.spawn(ctx, record, log, cursor, 2)         # a full pool: this worker's inline stack
    wl.join(ctx, h)                                   # would wait forever for its own stack
    record(ctx, log, cursor, 3)


@warploop.task(signature={"out": "*i64", "lo": "i32", "hi": "i32"})
@triton.jit
def fanout(ctx, out, lo, hi):
    """One task per leaf of [lo, hi), split in halves: hi - lo leaves, 2 (hi - lo) - 1 tasks."""
    if hi - lo > 1:
        mid = (lo + hi) // 2
        wl.spawn(ctx, fanout, out, lo, mid)
        wl.spawn(ctx, fanout, out, mid, hi)
    else:
        tl.atomic_add(out, 1)


@warploop.task(signature={"out": "*i64", "depth": "i32"})
@triton.jit
def dive(ctx, out, depth):
    """Recursion `depth` deep: every level stays alive (structured completion) until the bottom is done."""
    if depth > 0:
        wl.spawn(ctx, dive, out, depth - 1)
    tl.atomic_add(out, 1)


@warploop.task(signature={"depth": "i32", "out": "*i64"})
@triton.jit
def chain(ctx, depth, out):
    """A chain of continuations: each link attaches the next to a spawned no-op child."""
    if depth > 0:
        h = wl.spawn(ctx, chain, 0, out)
        wl.then(ctx, h, chain, depth - 1, out)
    tl.atomic_add(out, 1)


@warploop.task(signature={"out": "*i64"})
@triton.jit
def every_call(ctx, out):
    """spawn, then and join in one body, for the compile check (few call sites: ptxas time)."""
    h = wl.spawn(ctx, dive, out, 0)
    wl.then(ctx, h, dive, out, 0)
    wl.join(ctx, h)


TASKS = [record, spawn_n, spawn_join, fanout, dive, chain]


def runtime(workers: int = 2) -> warploop.Runtime:
    return warploop.Runtime(device="cpu", tasks=TASKS, workers=workers, pool=2)


def entries(log, cursor) -> list[tuple[int, int]]:
    return [(int(log[2 * i]), int(log[2 * i + 1])) for i in range(int(cursor[0]))]


def test_inline_children_run_on_the_spawner_right_after_its_body_last_first():
    log, cursor = torch.full((64,), -1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with runtime() as rt:
        rt.submit(spawn_n, log, cursor, 5).result(timeout=60)
        done = entries(log, cursor)
        assert rt.status().pending == ()
    # The root holds a slot of the front's (host submissions have their own); children 10 and 11
    # took the 2 shared slots (queued on the ring); 12-14 found the pool full and went on the root's
    # worker's inline stack: they run there as soon as the root's body returns, newest first, before
    # the worker takes the ring's children.
    tags = [t for t, _ in done]
    assert tags == [0, 14, 13, 12, 10, 11]
    root_worker = done[0][1]
    assert all(w == root_worker for _, w in done[1:4])


def test_join_on_an_inlined_child_hands_it_to_another_worker():
    log, cursor = torch.full((16,), -1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with runtime(workers=2) as rt:
        rt.submit(spawn_join, log, cursor).result(timeout=60)
        done = entries(log, cursor)
    tags = [t for t, _ in done]
    assert sorted(tags) == [0, 1, 2, 3] and tags.index(2) < tags.index(3)
    joiner = done[tags.index(3)][1]
    assert done[tags.index(2)][1] != joiner       # spilled to the ring, run by the other worker


def test_fanout_far_past_the_pool_completes():
    out = torch.zeros(1, dtype=torch.int64)
    with runtime() as rt:
        rt.submit(fanout, out, 0, 64).result(timeout=120)        # 127 tasks through 2 shared slots
        status = rt.status()
    assert int(out[0]) == 64
    assert status.pending == () and status.issued == status.completed


def test_recursion_deeper_than_the_pool_completes():
    out = torch.zeros(1, dtype=torch.int64)
    with runtime() as rt:
        rt.submit(dive, out, 24).result(timeout=60)              # 25 levels alive at once
    assert int(out[0]) == 25


def test_then_chains_keep_working_under_a_full_pool():
    out = torch.zeros(1, dtype=torch.int64)
    with runtime() as rt:
        rt.submit(chain, 20, out).result(timeout=60)
        assert rt.status().pending == ()
    assert int(out[0]) == 41                                      # 21 links and 20 no-op children


def test_host_submissions_into_a_full_pool_wait_for_nothing():
    log, cursor = torch.full((64,), -1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with runtime() as rt:
        futures = [rt.submit(record, log, cursor, 100 + i) for i in range(12)]    # the front's reserve
        assert [f.result(timeout=60) for f in futures] == [0] * 12
    assert sorted(t for t, _ in entries(log, cursor)) == list(range(100, 112))


def test_the_inline_path_compiles_for_a_gpu_without_one():
    """spawn (shared pool, reserve, inline stack), join (spill) and then, in the real resident kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from warploop.runtime import codegen
    from warploop.runtime.tasks import lookup

    module = codegen.build([lookup(every_call), lookup(dive)])
    src = ASTSource(fn=module.resident, signature={"arena": "*i32"},
                    constexprs={"INLINE": False, "TRACE": False, "BACKEND": "cuda"})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    assert ".entry resident" in ptx           # it compiled: no recursion, every loop-carried type agrees


def test_the_fanout_bench_runs_and_checks_itself():
    from warploop.bench.runtime_fanout import fanout_figures

    fig = fanout_figures(torch, leaves=8, pool=2, device="cpu")
    assert fig["fanout_tasks"] == 15 and fig["fanout_ok"] and fig["flat_ok"]
    assert fig["fanout_tasks_per_s"] > 0 and fig["fanout_vs_flat"] > 0


@warploop.task(signature={"log": "*i32", "cursor": "*i32", "first": "i64"})
@triton.jit
def inline_parent(ctx, log, cursor, first):
    """Runs inline; waits until `first` has completed elsewhere (its shared slot is free again), then
    spawns: the child stays on this worker's stack although the pool now has room."""
    wl.join(ctx, first)
    child = wl.spawn(ctx, record, log, cursor, 21)
    on_stack = tl.load(p64(ctx + L.X_STACK)) == child        # the top of this worker's inline stack
    record(ctx, log, cursor, tl.where(on_stack, 20, 19))


@warploop.task(signature={"log": "*i32", "cursor": "*i32"})
@triton.jit
def subtree_root(ctx, log, cursor):
    wl.spawn(ctx, record, log, cursor, 0)                  # the 2 shared slots: the ring
    first = wl.spawn(ctx, record, log, cursor, 1)
    wl.spawn(ctx, inline_parent, log, cursor, first)       # a full pool: inline


def test_the_children_of_an_inline_task_are_inline_too():
    log, cursor = torch.full((32,), -1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with warploop.Runtime(device="cpu", tasks=TASKS + [inline_parent, subtree_root], workers=2, pool=2) as rt:
        rt.submit(subtree_root, log, cursor).result(timeout=60)
        done = entries(log, cursor)
    tags = [t for t, _ in done]
    assert tags == [0, 1, 20, 21]
    # 0 and 1 ran on the other worker during the join; 21 went on the parent's inline stack (20, not
    # 19) and ran on the parent's worker, though the shared slots were free again when it was spawned.
    assert done[2][1] == done[3][1] != done[1][1]
