"""What task bodies call: spawn, join, then, wait, set_result, task_id, worker_id, external.

    from warploop.runtime import device as wl

    @warploop.task(signature={"x": "*fp32", "n": "i32"})
    @triton.jit
    def parent(ctx, x, n):
        h = wl.spawn(ctx, child, x, n)      # child: another @warploop.task
        wl.then(ctx, h, report, x)          # runs after h, without holding this worker
        wl.join(ctx, h)                     # holds this worker until h completes

Arguments after the task are its arguments in signature order (at most 12): pointers, integers
or fp32 values; the callee's signature says how each is stored. A handle is an int64 task id.

Completion is structured: a task's handle completes only when its body has returned and every
task it spawned or attached with `then` has completed. So the host's future for a root task
resolves when the whole tree is done, and `then` on a handle waits for that handle's tree.

A spawn never waits for room: into a full pool the child runs inline on the spawning worker,
after the spawning body returns (slots.py; docs/runtime.md, "Dynamic work at any size").

`join` spins, holding its worker: a program whose joins nest deeper than the number of workers
deadlocks on the GPU (the CPU executor runs other tasks while joining). Prefer `then`.
"""
import triton
import triton.language as tl

from warploop.runtime import descriptor as D
from warploop.runtime import errors as E
from warploop.runtime import external as X
from warploop.runtime import layout as L
from warploop.runtime.sched import attach, never_issued, push, report_error, write_header
from warploop.runtime.slots import alloc_task, push_inline, spill_inline
from warploop.runtime.sync import ARG_WORD, CTX_BASE, CTX_WORDS, desc_of, i64, meta32, meta64, p64, wait_ge, wait_pair

ERR_BAD_HANDLE = tl.constexpr(E.ERR_BAD_HANDLE)
K_PTR = tl.constexpr(D.K_PTR)
K_FP32 = tl.constexpr(D.K_FP32)
K_NONE = tl.constexpr(D.K_NONE)
EXTERNAL_TICKET = tl.constexpr(X.EXTERNAL_TICKET)
OP_EXTERNAL = tl.constexpr(X.OP_EXTERNAL)
PORTABLE = tl.constexpr("portable")   # a default for BACKEND: a plain str default is not a constexpr in Triton


@triton.jit
def arena_of(ctx):
    return ctx - (CTX_BASE + CTX_WORDS * tl.load(ctx + L.X_WORKER))


@triton.jit
def task_id(ctx):
    """The running dynamic task's handle (-1 inside a static graph)."""
    return tl.load(p64(ctx + L.X_TASK))


@triton.jit
def worker_id(ctx):
    return tl.load(ctx + L.X_WORKER)


@triton.jit
def ports(ctx):
    """The warploop.std port array given as Runtime(ports=...): std.port(wl.ports(ctx), index)."""
    return tl.load(p64(arena_of(ctx) + L.H_PORTS_ADDR)).to(tl.pointer_type(tl.int64))


@triton.jit
def _word(x, kind: tl.constexpr):
    if kind == K_PTR:
        w = x.to(tl.int64)
    elif kind == K_FP32:
        w = (tl.zeros([], tl.float32) + x).to(tl.int32, bitcast=True).to(tl.int64)
    else:
        w = tl.zeros([], tl.int64) + x
    return w


@triton.jit
def _store_args(d, task, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11):
    a = p64(d + ARG_WORD)
    if task.kinds[0] != K_NONE:
        tl.store(a + 0, _word(a0, task.kinds[0]))
    if task.kinds[1] != K_NONE:
        tl.store(a + 1, _word(a1, task.kinds[1]))
    if task.kinds[2] != K_NONE:
        tl.store(a + 2, _word(a2, task.kinds[2]))
    if task.kinds[3] != K_NONE:
        tl.store(a + 3, _word(a3, task.kinds[3]))
    if task.kinds[4] != K_NONE:
        tl.store(a + 4, _word(a4, task.kinds[4]))
    if task.kinds[5] != K_NONE:
        tl.store(a + 5, _word(a5, task.kinds[5]))
    if task.kinds[6] != K_NONE:
        tl.store(a + 6, _word(a6, task.kinds[6]))
    if task.kinds[7] != K_NONE:
        tl.store(a + 7, _word(a7, task.kinds[7]))
    if task.kinds[8] != K_NONE:
        tl.store(a + 8, _word(a8, task.kinds[8]))
    if task.kinds[9] != K_NONE:
        tl.store(a + 9, _word(a9, task.kinds[9]))
    if task.kinds[10] != K_NONE:
        tl.store(a + 10, _word(a10, task.kinds[10]))
    if task.kinds[11] != K_NONE:
        tl.store(a + 11, _word(a11, task.kinds[11]))


@triton.jit
def _new_task(ctx, task, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11):
    """Allocate a child of the running task and write its descriptor: (its id or -1, reserved)."""
    arena = arena_of(ctx)
    tid, reserved = alloc_task(arena, task_id(ctx), i64(-1), worker_id(ctx))
    if tid >= 0:
        d = desc_of(arena, tid % tl.load(arena + L.H_POOL))
        write_header(d, task.opcode)
        _store_args(d, task, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11)
    return tid, reserved


@triton.jit
def spawn(ctx, task, a0=0, a1=0, a2=0, a3=0, a4=0, a5=0, a6=0, a7=0, a8=0, a9=0, a10=0, a11=0):
    """Queue `task(a0, ...)` to run on any worker; returns its handle.

    Into a full pool the child takes one of this worker's reserved slots and runs *inline*: on this
    worker, after the running body returns, before the worker takes other work; children inlined
    by one body run last-spawned first. The children of an inline task are inline too, whatever
    the pool holds, so a subtree that went inline is finished depth first by its worker (which
    bounds the reserve it needs). -1 only when the reserve is full too (the runtime aborts).
    """
    tid, reserved = _new_task(ctx, task, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11)
    if tid >= 0:
        if reserved | (tl.load(ctx + L.X_INLINE) != 0):
            push_inline(arena_of(ctx), ctx, tid)
        else:
            push(arena_of(ctx), tid)
    return tid


@triton.jit
def then(ctx, handle, task, a0=0, a1=0, a2=0, a3=0, a4=0, a5=0, a6=0, a7=0, a8=0, a9=0, a10=0, a11=0):
    """Queue `task(a0, ...)` to run once `handle` completes; returns the continuation's handle."""
    tid, reserved = _new_task(ctx, task, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11)
    if tid >= 0:
        attach(arena_of(ctx), handle, tid, worker_id(ctx))
    return tid


@triton.jit
def join(ctx, handle, BACKEND: tl.constexpr = PORTABLE):
    """Wait, holding this worker, until `handle` completes (or the runtime is aborted).

    Pass the task's `BACKEND` parameter where it has one: on CUDA one thread then polls. This
    worker's inline stack goes to the ready ring first (the joined child may be on it).
    """
    arena = arena_of(ctx)
    spill_inline(arena, ctx)
    if never_issued(arena, handle):
        report_error(arena, ERR_BAD_HANDLE, 0, worker_id(ctx), 0, handle, 0)
    else:
        tl.store(ctx + L.X_DETAIL, handle.to(tl.int32))
        tl.store(ctx + L.X_STATE, L.S_JOINING)
        wait_ge(arena, meta64(arena, L.M_DONE, handle % tl.load(arena + L.H_POOL)), handle, BACKEND)
        tl.store(ctx + L.X_STATE, L.S_RUNNING)


@triton.jit
def wait(ctx, BACKEND: tl.constexpr = PORTABLE):
    """In a task registered with waits=True: wait here for the node's predecessors.

    Call it after issuing the loads that need no predecessor (weights), so they overlap the wait.
    Outside a static graph it returns at once. Pass the task's `BACKEND` parameter: on CUDA one
    thread then polls with ld.acquire; "portable" polls in every thread and acquires with a CAS.
    """
    arena = arena_of(ctx)
    counters = tl.load(p64(ctx + L.X_COUNTERS)).to(tl.pointer_type(tl.int64))
    # Every word is read before the first poll: the poll's acquire invalidates L1, so a word read
    # after it would cost an L2 round trip of its own (and on a loaded GPU that is microseconds).
    c0 = tl.load(ctx + L.X_WAIT)
    c1 = tl.load(ctx + L.X_WAIT + 1)
    t0 = tl.load(p64(ctx + L.X_WAIT_TARGET))
    t1 = tl.load(p64(ctx + L.X_WAIT_TARGET) + 1)
    wait_pair(arena, ctx, counters, c0, t0, c1, t1, BACKEND)


@triton.jit
def set_result(ctx, value):
    """Set the running task's int64 result, which the host's Future.result() returns."""
    tid = task_id(ctx)
    if tid >= 0:
        arena = arena_of(ctx)
        tl.store(meta64(arena, L.M_RESULT, tid % tl.load(arena + L.H_POOL)), i64(value))


@triton.jit
def external(ctx):
    """A handle that the host completes: `then`/`join` on it wait for rt.complete_external(h, status,
    result), which the warploop.std server does for a call posted with then=h + 1. It is never
    queued and has no parent (its status is data, read with `status`). -1 if no slot is left."""
    arena = arena_of(ctx)
    tid, reserved = alloc_task(arena, i64(-1), i64(EXTERNAL_TICKET), worker_id(ctx))
    if tid >= 0:
        write_header(desc_of(arena, tid % tl.load(arena + L.H_POOL)), OP_EXTERNAL)
    return tid


@triton.jit
def result(ctx, handle):
    """The int64 result of a completed handle: its set_result, or the host's for an external handle.
    Read it in a continuation of `handle` (its slot is reused P tasks later)."""
    arena = arena_of(ctx)
    return tl.load(meta64(arena, L.M_RESULT, handle % tl.load(arena + L.H_POOL)), volatile=True)


@triton.jit
def status(ctx, handle):
    """The status of a completed handle: 0, a runtime error code, or the host's for an external handle."""
    arena = arena_of(ctx)
    return tl.load(meta32(arena, L.M_STATUS, handle % tl.load(arena + L.H_POOL)), volatile=True)
